"""The whole lab as a child process, for the benchmarks and the tests that drive one.

`start_lab` runs `python -m controlplane.lab` in a var dir, database, Redis database and
ports of its own, under a parent-death signal (a killed caller stops its lab), and returns
once it printed its API token; `stop_lab` stops it and drops its database. `describe_lab`
writes what a second process needs to drive a running lab (its URLs, token, demo key,
database, var dir, pid) and `attach_lab` reads it back: the benchmarks' `--lab FILE`, so that
their smoke runs share one lab instead of starting one each. `running_lab` is either, as a
context manager that stops only a lab it started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import signal
import socket
import ssl
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from controlplane.lab import backing
from controlplane.lab.processes import die_with_parent
from controlplane.lab.waiting import wait_until
from controlplane.provisioning.local import free_port
from edge.local import admin_request

REPO = Path(__file__).resolve().parents[2]
# The lab's edges by region: (client URL, admin URL) at these offsets from --edge-port.
EDGE_OFFSETS = {"local:eu-frankfurt": (0, 10), "local:us-virginia": (1, 11)}


@dataclass
class Lab:
    pid: int  # the lab's process, leader of its process group
    base: str
    token: str
    demo_key: str
    edges: dict[str, tuple[str, str]]  # region key → (client URL, admin URL)
    database: str
    database_url: str
    var_dir: Path
    process: subprocess.Popen[str] | None = None  # None for a lab another process started


def api(method: str, url: str, token: str, body: Mapping[str, Any] | None = None,
        timeout_s: float = 10.0) -> Any:
    """One call to the lab's REST API with its token; the answer's JSON."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def iso_time(value: str) -> float:
    """An ISO 8601 time from the API as a Unix time."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def free_edge_base() -> int:
    """Four free ports for the lab's edges (base, base + 1, base + 10, base + 11), below the
    kernel's ephemeral range: a port the kernel hands out for bind(0) — as the lab's engines
    and relays get theirs, after this check — never lands on them."""
    low = 10000
    with contextlib.suppress(OSError, ValueError):
        low = min(int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]),
                  32768)
    for _ in range(100):
        base = random.randrange(10000, max(10001, low - 12))
        try:
            for offset in (0, 1, 10, 11):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base
    raise RuntimeError("no free edge ports")


class _LabOutput:
    """A starting lab's output, read on a thread of their own: a lab that exits while a
    process it started still holds the pipe (no end of file) must not block this one for
    ever, and the lab never blocks on a full pipe."""

    def __init__(self, process: subprocess.Popen[str], var_dir: Path,
                 on_line: Callable[[str], None] | None) -> None:
        self.process = process
        self.var_dir = var_dir
        self.on_line = on_line
        self.lines: queue.Queue[str] = queue.Queue()
        self.started = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for text in self.process.stdout:
            if not self.started.is_set():
                self.lines.put(text)
            elif self.on_line is not None:
                self.on_line(text)

    def token_line(self) -> str:
        """The API token once the lab printed it, else "" (raises if the lab exited)."""
        try:
            line = self.lines.get(timeout=0.5)
        except queue.Empty:
            line = ""
        if not line and self.process.poll() is not None:
            raise RuntimeError(f"the lab exited while starting (its logs: {self.var_dir}/lab/logs)")
        return line.split()[-1] if "API token" in line else ""

    def pass_on(self) -> None:
        """From now on each line goes to `on_line`, starting with those read so far."""
        self.started.set()
        while not self.lines.empty() and self.on_line is not None:
            self.on_line(self.lines.get())


def start_lab(var_dir: Path, engine: str = "enginesim", *, replicas_per_region: int = 1,
              extra: Sequence[str] = (), name_prefix: str = "meridian_bench_lab",
              env: Mapping[str, str] | None = None, start_timeout_s: float = 240,
              on_line: Callable[[str], None] | None = None) -> Lab:
    """A lab of its own (database, Redis database, ports, var dir) that dies with this
    process; `env` is added to its environment (and so to every process it starts);
    `on_line` sees each line it prints once it is up (else its output is drained)."""
    web = free_port()
    edge_base = free_edge_base()
    default_db = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/meridian")
    name = f"{name_prefix}_{web}"
    database_url = urlunsplit(urlsplit(default_db)._replace(path=f"/{name}"))
    child_env = {**os.environ, "DATABASE_URL": database_url,
                 "REDIS_URL": os.environ.get("BENCH_REDIS_URL",
                                             f"redis://127.0.0.1:6379/{backing.lab_redis_db(web)}"),
                 "MERIDIAN_LAB": "1", **(env or {})}
    process = subprocess.Popen(
        [sys.executable, "-m", "controlplane.lab", "--web-port", str(web), "--var-dir",
         str(var_dir), "--edge-port", str(edge_base), "--replicas-per-region",
         str(replicas_per_region), "--engine", engine, *extra],
        cwd=REPO, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # A killed caller stops its lab (SIGTERM: the lab stops its processes and engines).
        start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM))
    edges = {region: (f"http://127.0.0.1:{edge_base + client}",
                      f"http://127.0.0.1:{edge_base + admin}")
             for region, (client, admin) in EDGE_OFFSETS.items()}
    lab = Lab(process.pid, f"http://127.0.0.1:{web}", "", "", edges, name, database_url,
              var_dir, process)
    output = _LabOutput(process, var_dir, on_line)
    try:
        lab.token = wait_until(output.token_line, start_timeout_s,
                               "the lab to print its API token", every_s=0.0)
    except BaseException:
        stop_lab(lab)  # nothing of a lab that did not start is left: processes, database
        raise
    output.pass_on()
    lab.demo_key = (var_dir / "lab" / "demo-api-key").read_text().strip()
    return lab


def stop_lab(lab: Lab) -> None:
    """SIGINT the lab's process group (it stops everything it started), SIGKILL it after 90 s,
    and drop its database. Only for a lab this process started."""
    if lab.process is None:
        raise ValueError("this lab was started by another process: it stops it")
    try:
        os.killpg(lab.pid, signal.SIGINT)
        lab.process.wait(timeout=90)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(lab.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            lab.process.wait(timeout=10)
    import psycopg

    params = urlsplit(lab.database_url)
    with psycopg.connect(host=params.hostname, port=params.port or 5432,
                         user=params.username or "postgres", password=params.password,
                         dbname="postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{lab.database}" WITH (FORCE)')


def add_lab_option(parser: argparse.ArgumentParser, started_with: str = "") -> None:
    """A benchmark's `--lab FILE`: drive the lab FILE describes instead of starting one;
    `started_with` says what that lab must have been started with (its SMOKE_LAB)."""
    needs = f"; started with {started_with}" if started_with else ""
    parser.add_argument("--lab", type=Path, metavar="FILE",
                        help=f"drive the running lab FILE describes (controlplane.lab."
                             f"child_lab.describe_lab{needs}) instead of starting one")


def describe_lab(lab: Lab, path: Path) -> None:
    """What `attach_lab` needs to drive this lab from another process, written to `path`."""
    document = {"pid": lab.pid, "base": lab.base, "token": lab.token,
                "demo_key": lab.demo_key, "edges": lab.edges, "database": lab.database,
                "database_url": lab.database_url, "var_dir": str(lab.var_dir)}
    path.write_text(json.dumps(document))


def attach_lab(path: Path) -> Lab:
    """A lab another process started and described (`describe_lab`)."""
    document = json.loads(path.read_text())
    edges = {region: (urls[0], urls[1]) for region, urls in document["edges"].items()}
    return Lab(int(document["pid"]), document["base"], document["token"],
               document["demo_key"], edges, document["database"], document["database_url"],
               Path(document["var_dir"]))


@contextlib.contextmanager
def running_lab(attach: Path | None, var_dir: Path, **start: Any) -> Iterator[Lab]:
    """The lab described in `attach` (left running), else a new one in `var_dir` (started
    with `start_lab(var_dir, **start)`, stopped at the end)."""
    if attach is not None:
        yield attach_lab(attach)
        return
    lab = start_lab(var_dir, **start)
    try:
        yield lab
    finally:
        stop_lab(lab)


def edge_admin_get(lab: Lab, admin: str, path: str) -> Any:
    """GET an admin path of one of the lab's edges, signed with the edge's secret (the lab
    writes each edge's secret under its var dir, and which admin URL each is for)."""
    secrets = json.loads((lab.var_dir / "lab" / "edge-admin.json").read_text())
    secret = Path(secrets[admin]).read_bytes().strip()
    return admin_request(admin, path, secret, timeout_s=2)


def engine_client_context(lab: Lab) -> ssl.SSLContext:
    """A TLS context for calling the lab's engines directly (they demand a client certificate
    from the engine CA): the control plane's own client certificate, which the lab installs
    under its var dir (controlplane.core.certificates.client_context)."""
    bundle = lab.var_dir / "keys" / "clients" / "scraper-controlplane"
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                         cafile=str(bundle / "ca.pem"))
    context.load_cert_chain(str(bundle / "cert.pem"), str(bundle / "key.pem"))
    return context


def edge_replicas(lab: Lab, admin: str) -> list[dict[str, Any]]:
    """The replicas one of the lab's edges routes to now (its /admin/replicas)."""
    return list(edge_admin_get(lab, admin, "/admin/replicas")["replicas"])


def wait_ready(lab: Lab, replicas: int, timeout_s: float = 180) -> None:
    """Until the lab has `replicas` ready replicas and every edge's table lists as many."""
    def ready() -> bool:
        rows = api("GET", f"{lab.base}/api/v1/replicas/?state=ready&page_size=100",
                   lab.token)["results"]
        return len(rows) >= replicas and all(
            len(edge_replicas(lab, admin)) >= replicas for _, admin in lab.edges.values())

    wait_until(ready, timeout_s, f"{replicas} ready replicas in the lab and on every edge",
               every_s=1.0, ignore=(OSError, KeyError))
