"""The Celery app: three queues, `control` for fast loops, `provision` for slow provider jobs
and `batch` for the batch runner (a run holds its worker for up to BATCH_TASK_BUDGET_S).

Every worker and every beat records a heartbeat in Redis every HEARTBEAT_S
(controlplane.core.heartbeats), which /api/v1/status/ reads instead of pinging workers: a
worker from its own event loop's timer (a bootstep), beat from its scheduler's tick."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from celery import Celery, bootsteps, signals
from kombu import Queue

from controlplane.core import heartbeats
from controlplane.core.redis_clients import redis_client

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("meridian")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_queues = (Queue("control"), Queue("provision"), Queue("batch"))
app.autodiscover_tasks()

logger = logging.getLogger(__name__)
DEFAULT_BEAT_SCHEDULE = "celerybeat-schedule"


def _beat_now(kind: str, name: str, queues: tuple[str, ...] = ()) -> None:
    """Record this process's heartbeat; a failure is logged, never raised into Celery's loop
    (status reports the record as stale once Redis is back, or unreachable meanwhile)."""
    try:
        heartbeats.record(redis_client(), heartbeats.this_process(kind, name, queues))
    except Exception as exc:  # Redis down: the next beat tries again
        logger.warning("heartbeat of %s not recorded: %s", name, exc)


class WorkerHeartbeat(bootsteps.StartStopStep):
    """A worker's heartbeat, named by its node name, with the queues it consumes; from the
    worker's timer, so a worker whose main loop is stuck stops beating."""

    requires = {"celery.worker.components:Timer"}

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.tref: Any = None

    def start(self, worker: Any) -> None:
        queues = tuple(worker.app.amqp.queues.consume_from or ())

        def beat() -> None:
            _beat_now(heartbeats.WORKER, worker.hostname, queues)

        beat()
        self.tref = worker.timer.call_repeatedly(heartbeats.interval_s(), beat)

    def stop(self, worker: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None
        try:
            heartbeats.forget(redis_client(), heartbeats.WORKER, worker.hostname)
        except Exception as exc:  # its record goes stale, then expires
            logger.warning("heartbeat of %s not removed: %s", worker.hostname, exc)


app.steps["worker"].add(WorkerHeartbeat)


def beat_name(schedule_filename: str | None) -> str:
    """`beat@host`, or `beat-<schedule file>@host` for a beat with a schedule file of its
    own: the same name for a beat started again, a different one for a second beat."""
    stem = Path(schedule_filename or DEFAULT_BEAT_SCHEDULE).name
    suffix = "" if stem == DEFAULT_BEAT_SCHEDULE else f"-{stem}"
    return f"beat{suffix}@{socket.gethostname()}"


@signals.beat_init.connect
def _beat_heartbeats(sender: Any, **kwargs: Any) -> None:
    """Beat records its heartbeat from its scheduler's tick, at most every HEARTBEAT_S, and
    ticks at least that often; a beat that stops in order removes its record."""
    scheduler = sender.scheduler
    name = beat_name(getattr(sender, "schedule_filename", None))
    every_s = heartbeats.interval_s()
    tick, sync = scheduler.tick, sender.sync
    last = [0.0]

    def tick_and_beat(*args: Any, **kw: Any) -> float:
        if time.monotonic() - last[0] >= every_s * 0.9:
            _beat_now(heartbeats.BEAT, name)
            last[0] = time.monotonic()
        interval = tick(*args, **kw)
        return min(interval, every_s) if interval else interval

    def sync_and_forget() -> None:
        try:
            sync()
        finally:
            try:
                heartbeats.forget(redis_client(), heartbeats.BEAT, name)
            except Exception as exc:  # its record goes stale, then expires
                logger.warning("heartbeat of %s not removed: %s", name, exc)

    scheduler.tick = tick_and_beat
    sender.sync = sync_and_forget
