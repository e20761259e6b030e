"""`make up` as a newcomer meets it: the lab starts, answers, and Ctrl-C stops every process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from controlplane.lab import backing
from controlplane.lab.processes import die_with_parent
from controlplane.lab.waiting import wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str, token: str) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_lab_starts_serves_and_stops(tmp_path, settings):  # type: ignore[no-untyped-def]
    port = free_port()
    edge_port = free_edge_ports()
    parts = urlsplit(settings.DATABASE_URL)
    lab_db = f"meridian_e2e_{port}"
    env = {
        **os.environ,
        "DATABASE_URL": urlunsplit(parts._replace(path=f"/{lab_db}")),
        # A Redis database of its own: another lab on this machine must not take its tasks.
        "REDIS_URL": f"redis://127.0.0.1:6379/{backing.lab_redis_db(port)}",
    }
    lab = subprocess.Popen(
        [sys.executable, "-m", "controlplane.lab", "--web-port", str(port), "--var-dir", str(tmp_path),
         "--edge-port", str(edge_port)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM),
    )
    output: list[str] = []
    engine_pids: list[int] = []
    try:
        token = None
        deadline = time.monotonic() + 180
        while token is None and time.monotonic() < deadline:
            line = lab.stdout.readline()  # type: ignore[union-attr]
            assert line or lab.poll() is None, "".join(output)
            output.append(line)
            if "API token" in line:
                token = line.split()[-1]
        assert token and token.startswith("mrd_"), "".join(output)
        def settled() -> dict | None:
            # Every queue's worker answers: control, provision and batch.
            code, body = get_json(f"http://127.0.0.1:{port}/api/v1/status/", token)
            queues = {w.split("@")[0] for w in body.get("workers", [])}
            ready = code == 200 and body["celery"]["ok"] and body["beat"]["ok"] \
                and {"control", "provision", "batch"} <= queues
            return body if ready else None

        body = wait_until(settled, deadline - time.monotonic(),
                          "the lab's status with every worker and beat alive", every_s=0.5,
                          ignore=(OSError,))
        assert body.get("database", {}).get("ok"), body
        assert body["celery"]["ok"] and body["beat"]["ok"], body
        assert {"control", "provision", "batch"} <= {w.split("@")[0] for w in body["workers"]}, body
        code, offers = get_json(f"http://127.0.0.1:{port}/api/v1/offers/?gpu=H100", token)
        assert code == 200 and offers["count"] > 0
        docs = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/docs/", timeout=5).read()
        assert b"swagger-ui" in docs and b"cdn" not in docs.lower()
        api = f"http://127.0.0.1:{port}/api/v1"
        ready = wait_for(lambda: _ready_replicas(api, token), lambda r: len(r) >= 3, deadline)
        key = (tmp_path / "lab" / "demo-api-key").read_text().strip()
        # Traffic through the European edge, once tables carry the ready replicas.
        answer = wait_for(lambda: _chat(edge_port, key), lambda a: a[0] == 200, deadline)
        assert answer[1].rstrip().endswith(b"data: [DONE]"), answer
        # Kill one replica's engine: reconcile notices, records it, and replaces it.
        victim = ready[0]
        os.kill(_engine_pid(tmp_path, victim["public_id"]), signal.SIGKILL)
        wait_for(lambda: get_json(f"{api}/replicas/{victim['id']}/", token)[1],
                 lambda r: r["state"] in ("failed", "terminated"), deadline)
        replaced = wait_for(lambda: _ready_replicas(api, token),
                            lambda r: len(r) >= 3 and victim["id"] not in {x["id"] for x in r},
                            deadline)
        assert {r["region"] for r in replaced} == {r["region"] for r in ready}
        code, events = get_json(f"{api}/audit-log/?object_id={victim['id']}", token)
        assert "replica.failed" in {e["action"] for e in events["results"]}
        assert _chat(edge_port, key)[0] == 200
        engine_pids = [json.loads(p.read_text())["pid"]
                       for p in (tmp_path / "lab" / "replicas").glob("*.json")]
        assert len(engine_pids) >= 3
    finally:
        os.killpg(lab.pid, signal.SIGINT)
        rest, _ = lab.communicate(timeout=60)
    _drop_database(settings.DATABASE_URL, lab_db)
    assert lab.returncode == 0, "".join(output) + rest
    assert "stopped" in rest
    logs = tmp_path / "lab" / "logs"
    for name in ("web", "worker", "provisioner", "batcher", "beat", "edge-eu", "edge-us"):
        assert (logs / f"{name}.log").exists()
    for pattern in (f"--bind 127.0.0.1:{port}", f"--listen 127.0.0.1:{edge_port}"):
        leftovers = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True)
        assert leftovers.returncode == 1, (pattern, leftovers.stdout)
    assert not list((tmp_path / "lab" / "replicas").glob("*.json"))
    for pid in engine_pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def _drop_database(url: str, name: str) -> None:
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    from controlplane.env import database_from_url

    params = database_from_url("DATABASE_URL", url)
    conninfo = {"dbname": "postgres", "user": params["USER"], "host": params["HOST"],
                "port": params["PORT"]}
    given = make_conninfo(**{k: str(v) for k, v in conninfo.items() if v})
    with psycopg.connect(given, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def free_edge_ports() -> int:
    """A base port with the next two and the two ten above free (edge and admin ports)."""
    for _ in range(50):
        base = free_port()
        if base > 60000:
            continue
        try:
            for offset in (0, 1, 10, 11):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range for the edges")


def wait_for(fetch, done, deadline):  # type: ignore[no-untyped-def]
    """The first value of `fetch()` that is `done`, before `deadline` (a monotonic time)."""
    def answer():  # type: ignore[no-untyped-def]
        value = fetch()
        return (value,) if done(value) else None
    return wait_until(answer, deadline - time.monotonic(), "the lab's answer", every_s=0.5,
                      ignore=(OSError,))[0]


def _ready_replicas(api: str, token: str) -> list[dict]:
    code, body = get_json(f"{api}/replicas/?deployment=demo-chat&state=ready", token)
    return body.get("results", []) if code == 200 else []


def _chat(edge_port: int, key: str) -> tuple[int, bytes]:
    body = json.dumps({"model": "llama-3.1-8b", "stream": True, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{edge_port}/v1/chat/completions", data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _engine_pid(var_dir: Path, public_id: str) -> int:
    return int(json.loads((var_dir / "lab" / "replicas" / f"{public_id}.json").read_text())["pid"])
