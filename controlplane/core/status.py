"""The system's health at a glance: database, Redis, and the Celery workers and beat as their
heartbeats show them (controlplane.core.heartbeats). Nothing here waits on a worker: a
status read is a few round-trips to Postgres and Redis, whatever the workers are doing."""

from __future__ import annotations

import time
from typing import Any

from django.db import connection

from controlplane.celery import app
from controlplane.core import heartbeats
from controlplane.core.models import Heartbeat
from controlplane.core.redis_clients import redis_client

BEAT_HEARTBEAT = "celery-beat"


def _timed(check: Any) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        check()
    except Exception as exc:  # any failure is the answer we report
        return {"ok": False, "detail": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "detail": f"{(time.perf_counter() - started) * 1000:.1f} ms"}


def _database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


def _stale(beats: list[heartbeats.Heartbeat], now: float) -> str:
    return ", ".join(f"{b.name} (last heartbeat {b.age_s(now):.0f} s ago)"
                     for b in beats if not b.fresh(now))


def workers_check(beats: list[heartbeats.Heartbeat], now: float) -> dict[str, Any]:
    """ok when some worker beats, none is stale, and every queue has a fresh worker."""
    workers = [b for b in beats if b.kind == heartbeats.WORKER]
    if not workers:
        return {"ok": False, "detail": "no worker heartbeat recorded"}
    fresh = [b for b in workers if b.fresh(now)]
    problems = []
    if stale := _stale(workers, now):
        problems.append(f"stale: {stale}")
    served = {queue for b in fresh for queue in b.queues}
    if unserved := sorted({q.name for q in app.conf.task_queues or ()} - served):
        problems.append(f"no fresh worker consumes {', '.join(unserved)}")
    if problems:
        return {"ok": False, "detail": "; ".join(problems)}
    return {"ok": True, "detail": f"{len(fresh)} worker(s) fresh"}


def beat_check(beats: list[heartbeats.Heartbeat], now: float) -> dict[str, Any]:
    """ok when some beat ticks and none is stale."""
    beats = [b for b in beats if b.kind == heartbeats.BEAT]
    if not beats:
        return {"ok": False, "detail": "no beat heartbeat recorded"}
    if stale := _stale(beats, now):
        return {"ok": False, "detail": f"stale: {stale}"}
    return {"ok": True, "detail": ", ".join(f"{b.name}: last tick {b.age_s(now):.0f} s ago"
                                            for b in beats)}


def _described(beat: heartbeats.Heartbeat, now: float) -> dict[str, Any]:
    return {"kind": beat.kind, "name": beat.name, "hostname": beat.hostname, "pid": beat.pid,
            "queues": list(beat.queues), "at": beat.at, "age_s": round(beat.age_s(now), 1),
            "ok": beat.fresh(now)}


def collect() -> dict[str, Any]:
    database = _timed(_database)
    client = redis_client()
    beats: list[heartbeats.Heartbeat] = []
    redis_check = _timed(lambda: beats.extend(heartbeats.read_all(client)))
    now = time.time()
    if redis_check["ok"]:
        celery, beat = workers_check(beats, now), beat_check(beats, now)
    else:
        celery = beat = {"ok": False, "detail": "broker unreachable"}
    last_tick = None
    if database["ok"]:  # core.beat_tick: beat → broker → a control worker → Postgres
        row = Heartbeat.objects.filter(name=BEAT_HEARTBEAT).first()
        last_tick = row.at if row else None
    return {
        "ok": database["ok"] and redis_check["ok"],
        "database": database,
        "redis": redis_check,
        "celery": celery,
        "beat": beat,
        "workers": [b.name for b in beats if b.kind == heartbeats.WORKER and b.fresh(now)],
        "heartbeats": [_described(b, now) for b in beats],
        "stale_after_s": heartbeats.stale_after_s(),
        "last_beat_tick": last_tick,
    }
