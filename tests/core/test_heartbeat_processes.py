"""Real Celery processes record their heartbeats: a worker (from its timer) and beat (from its
tick), each with its pid and, for the worker, the queues it consumes; each removes its record
when it stops in order."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.celery import beat_name
from controlplane.core import heartbeats
from controlplane.core.redis_clients import redis_client
from controlplane.lab.processes import die_with_parent
from controlplane.lab.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
START_S = 120.0  # a backstop: importing Django and every app on a loaded machine


@pytest.fixture
def celery_process(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Started Celery processes (their output under tmp_path), stopped at the end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def start(started: list[subprocess.Popen[bytes]], tmp_path: Path, *argv: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "MERIDIAN_HEARTBEAT_S": "0.5"}
    log = open(tmp_path / f"celery-{len(started)}.log", "wb")  # noqa: SIM115 - the child's
    process = subprocess.Popen([sys.executable, "-m", "celery", "-A", "controlplane", *argv],
                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, preexec_fn=die_with_parent())
    log.close()
    started.append(process)
    return process


def record_of(name: str) -> heartbeats.Heartbeat | None:
    return next((b for b in heartbeats.read_all(redis_client()) if b.name == name), None)


def beats_twice_then_forgets(process: subprocess.Popen[bytes], name: str, tmp_path: Path
                             ) -> heartbeats.Heartbeat:
    """The process's first record, once a second one followed it; then SIGTERM, and the
    record is gone."""
    def first() -> heartbeats.Heartbeat | None:
        if process.poll() is not None:
            logs = "".join(p.read_text() for p in tmp_path.glob("celery-*.log"))
            raise AssertionError(f"exited with {process.returncode}:\n{logs[-3000:]}")
        return record_of(name)

    one = wait_until(first, START_S, f"{name}'s first heartbeat", every_s=0.2)
    wait_until(lambda: (b := record_of(name)) is not None and b.at > one.at, 30.0,
               f"{name}'s next heartbeat", every_s=0.1)
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=60)
    assert record_of(name) is None
    return one


def test_a_worker_records_its_heartbeat_and_removes_it_on_stop(  # type: ignore[no-untyped-def]
        celery_process, tmp_path):
    # A queue of its own: this worker takes no task another test sent.
    queue, name = f"heartbeat-{uuid.uuid4().hex[:8]}", f"hb-{uuid.uuid4().hex[:8]}@test"
    process = start(celery_process, tmp_path, "worker", "-Q", queue, "-n", name,
                    "--pool", "solo", "--without-mingle", "--without-gossip", "--loglevel",
                    "INFO")
    record = beats_twice_then_forgets(process, name, tmp_path)
    assert (record.kind, record.pid, record.queues) == (heartbeats.WORKER, process.pid, (queue,))


def test_beat_records_its_heartbeat_and_removes_it_on_stop(  # type: ignore[no-untyped-def]
        celery_process, tmp_path):
    schedule = tmp_path / f"beat-{uuid.uuid4().hex[:8]}"
    # The file scheduler with nothing scheduled: a beat that sends no task, on its own file.
    process = start(celery_process, tmp_path, "beat", "--scheduler",
                    "celery.beat:PersistentScheduler", "--schedule", str(schedule),
                    "--loglevel", "INFO")
    record = beats_twice_then_forgets(process, beat_name(str(schedule)), tmp_path)
    assert (record.kind, record.queues) == (heartbeats.BEAT, ())
    assert record.pid == process.pid
