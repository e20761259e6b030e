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
    parts = urlsplit(settings.DATABASE_URL)
    lab_db = f"meridian_e2e_{port}"
    env = {
        **os.environ,
        "DATABASE_URL": urlunsplit(parts._replace(path=f"/{lab_db}")),
        "MERIDIAN_BEAT_STALE_S": "60",
    }
    lab = subprocess.Popen(
        [sys.executable, "-m", "controlplane.lab", "--web-port", str(port), "--var-dir", str(tmp_path),
         "--no-fleet"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    output: list[str] = []
    try:
        token = None
        deadline = time.monotonic() + 120
        while token is None and time.monotonic() < deadline:
            line = lab.stdout.readline()  # type: ignore[union-attr]
            assert line or lab.poll() is None, "".join(output)
            output.append(line)
            if "API token" in line:
                token = line.split()[-1]
        assert token and token.startswith("mrd_"), "".join(output)
        body: dict = {}
        while time.monotonic() < deadline:
            try:
                code, body = get_json(f"http://127.0.0.1:{port}/api/v1/status/", token)
            except OSError:
                time.sleep(0.5)
                continue
            if code == 200 and body["celery"]["ok"] and body["beat"]["ok"]:
                break
            time.sleep(1)
        assert body.get("database", {}).get("ok"), body
        assert body["celery"]["ok"] and body["beat"]["ok"], body
        code, offers = get_json(f"http://127.0.0.1:{port}/api/v1/offers/?gpu=H100", token)
        assert code == 200 and offers["count"] > 0
        docs = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/docs/", timeout=5).read()
        assert b"swagger-ui" in docs and b"cdn" not in docs.lower()
    finally:
        os.killpg(lab.pid, signal.SIGINT)
        rest, _ = lab.communicate(timeout=60)
    _drop_database(settings.DATABASE_URL, lab_db)
    assert lab.returncode == 0, "".join(output) + rest
    assert "stopped" in rest
    logs = tmp_path / "lab" / "logs"
    for name in ("web", "worker", "beat"):
        assert (logs / f"{name}.log").exists()
    leftovers = subprocess.run(["pgrep", "-f", f"--bind 127.0.0.1:{port}"], capture_output=True)
    assert leftovers.returncode == 1, leftovers.stdout


def _drop_database(url: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    from controlplane.env import database_from_url

    params = database_from_url("DATABASE_URL", url)
    conninfo = {"dbname": "postgres", "user": params["USER"], "host": params["HOST"],
                "port": params["PORT"]}
    with psycopg.connect(**{k: v for k, v in conninfo.items() if v}, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
