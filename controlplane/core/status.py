"""The system's health at a glance: database, Redis, Celery workers and the last beat tick."""

from __future__ import annotations

import time
from typing import Any

import redis
from django.conf import settings
from django.db import connection
from django.utils import timezone

from controlplane.celery import app
from controlplane.core.models import Heartbeat

BEAT_HEARTBEAT = "celery-beat"


def redis_client(url: str | None = None, timeout_s: float = 1.0) -> redis.Redis:
    url = url or settings.REDIS_URL
    if url.startswith("redis+socket://"):
        url = "unix://" + url.removeprefix("redis+socket://")
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


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


def _workers(timeout_s: float) -> list[str]:
    replies = app.control.ping(timeout=timeout_s) or []
    return sorted(name for reply in replies for name in reply)


def collect(ping_timeout_s: float = 0.5) -> dict[str, Any]:
    database = _timed(_database)
    redis_check = _timed(lambda: redis_client().ping())
    workers: list[str] = []
    if redis_check["ok"]:
        celery = _timed(lambda: workers.extend(_workers(ping_timeout_s)))
        if celery["ok"]:
            celery = {"ok": bool(workers), "detail": f"{len(workers)} worker(s) answered"}
    else:
        celery = {"ok": False, "detail": "broker unreachable"}
    last_tick = None
    if database["ok"]:
        row = Heartbeat.objects.filter(name=BEAT_HEARTBEAT).first()
        last_tick = row.at if row else None
    if last_tick is None:
        beat = {"ok": False, "detail": "no beat tick recorded yet"}
    else:
        age = timezone.now() - last_tick
        fresh = age <= settings.MERIDIAN["BEAT_STALE_AFTER"]
        beat = {"ok": fresh, "detail": f"last tick {age.total_seconds():.0f} s ago"}
    return {
        "ok": database["ok"] and redis_check["ok"],
        "database": database,
        "redis": redis_check,
        "celery": celery,
        "beat": beat,
        "workers": workers,
        "last_beat_tick": last_tick,
    }
