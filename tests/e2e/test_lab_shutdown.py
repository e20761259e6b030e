"""The lab stops everything it started even when nobody reads its output any more, and a lab
killed outright leaves no engine behind (its guard stops them)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from controlplane.lab import backing
from controlplane.lab.guard import STOPPED
from controlplane.lab.waiting import WaitTimeout, wait_until
from controlplane.provisioning.local_processes import process_started
from tests.e2e.test_lab import REPO, _drop_database, free_edge_ports, free_port, get_json

pytestmark = pytest.mark.e2e


def _alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False


def _descendants(root: int) -> set[int]:
    """Every process below `root` now (engines started detached are still below it until the
    worker that started them exits)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    """The processes of `pids` still alive once all are gone or `timeout_s` has passed."""
    with contextlib.suppress(WaitTimeout):
        wait_until(lambda: not any(_alive(p) for p in pids), timeout_s, "the processes gone",
                   every_s=0.2)
    return {p for p in pids if _alive(p)}


def test_lab_whose_reader_is_gone_stops_every_process_on_sigterm(tmp_path, settings):  # type: ignore[no-untyped-def]
    port = free_port()
    parts = urlsplit(settings.DATABASE_URL)
    lab_db = f"meridian_e2e_{port}"
    env = {**os.environ, "DATABASE_URL": urlunsplit(parts._replace(path=f"/{lab_db}")),
           "REDIS_URL": f"redis://127.0.0.1:6379/{backing.lab_redis_db(port)}"}
    read_end, write_end = os.pipe()
    lab = subprocess.Popen(
        [sys.executable, "-m", "controlplane.lab", "--web-port", str(port), "--var-dir",
         str(tmp_path), "--edge-port", str(free_edge_ports()), "--prometheus-port",
         str(free_port())],
        cwd=REPO, env=env, stdout=write_end, stderr=write_end, start_new_session=True,
    )
    os.close(write_end)
    reader = os.fdopen(read_end, "rb")
    records = tmp_path / "lab" / "replicas"
    started: set[int] = set()
    try:
        output = b""
        deadline = time.monotonic() + 180
        while b"Meridian lab is up" not in output and time.monotonic() < deadline:
            chunk = reader.read1(65536)
            assert chunk, output.decode(errors="replace")
            output += chunk
        token = (tmp_path / "lab" / "admin-token").read_text().strip()
        api = f"http://127.0.0.1:{port}/api/v1"

        def three_ready() -> bool:  # the engines and relays the worker starts
            code, body = get_json(f"{api}/replicas/?deployment=demo-chat&state=ready", token)
            return code == 200 and body["count"] >= 3

        wait_until(three_ready, max(0.0, deadline - time.monotonic()),
                   "three ready replicas of demo-chat", every_s=1.0, ignore=(OSError,))
        engines = {json.loads(p.read_text())[key] for p in records.glob("*.json")
                   for key in ("pid", "relay_pid")}
        reader.close()  # the process reading the lab's output exits
        started = _descendants(lab.pid)
        assert engines <= started and len(started) >= 12, (engines, started)
        lab.send_signal(signal.SIGTERM)  # the lab alone, as `kill <pid>` would
        lab.wait(timeout=90)
        assert not _wait_gone(started, 60), "left running"
        assert not list(records.glob("*.json"))
    finally:
        if lab.poll() is None:
            os.killpg(lab.pid, signal.SIGKILL)
            lab.wait()
        for pid in started:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        _drop_database(settings.DATABASE_URL, lab_db)


def _record(state_dir: Path, name: str) -> subprocess.Popen[bytes]:
    """A fake replica: a detached process and the record LocalProvider would write for it."""
    argv = ["sleep", "300"]
    process = subprocess.Popen(argv, start_new_session=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / f"{name}.json").write_text(json.dumps({
        "replica_id": name, "pid": process.pid, "cmdline": argv,
        "pid_started": process_started(process.pid), "relay_pid": None}))
    return process


def _guard(state_dir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "controlplane.lab.guard", str(state_dir)],
                            stdin=subprocess.PIPE, cwd=REPO)


def test_guard_stops_recorded_engines_when_the_lab_dies_without_cleanup(tmp_path):  # type: ignore[no-untyped-def]
    engine = _record(tmp_path, "r-1")
    guard = _guard(tmp_path)
    try:
        assert guard.stdin is not None
        guard.stdin.close()  # what the kernel does when the lab is SIGKILLed
        assert engine.wait(timeout=30) is not None
        guard.wait(timeout=30)
    finally:
        engine.kill()
        guard.kill()


def test_guard_leaves_everything_alone_after_an_orderly_stop(tmp_path):  # type: ignore[no-untyped-def]
    engine = _record(tmp_path, "r-1")
    guard = _guard(tmp_path)
    try:
        assert guard.stdin is not None
        guard.stdin.write(STOPPED)
        guard.stdin.close()
        assert guard.wait(timeout=30) == 0
        assert engine.poll() is None
    finally:
        engine.kill()
        guard.kill()
        engine.wait()
