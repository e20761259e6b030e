"""Heartbeats: every Celery worker and beat records in Redis, every HEARTBEAT_S, that it is
alive (`controlplane/celery.py` wires it in), and the status endpoint reads those records.

One key per process (`meridian:heartbeat:<kind>:<name>`, JSON, with a TTL of
HEARTBEAT_FORGET_AFTER) plus a set that indexes them, so that reading them all is two
round-trips, never a broadcast. A record older than HEARTBEAT_S × HEARTBEAT_MISSED is stale:
its process missed that many beats. A process that stops in order deletes its record; one
that dies keeps it, reported stale, until the TTL forgets it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

import redis
from django.conf import settings

INDEX_KEY = "meridian:heartbeats"
KEY_PREFIX = "meridian:heartbeat:"
WORKER, BEAT = "worker", "beat"


@dataclass(frozen=True)
class Heartbeat:
    """One process's last heartbeat: `name` is a Celery worker's node name (`control@host`)
    or a beat's (`beat@host`, with its schedule file when not the default one)."""

    kind: str
    name: str
    hostname: str
    pid: int
    queues: tuple[str, ...]
    at: float  # Unix time, the writer's clock

    @property
    def key(self) -> str:
        return key_of(self.kind, self.name)

    def age_s(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.at)

    def fresh(self, now: float | None = None) -> bool:
        return self.age_s(now) <= stale_after_s()


def key_of(kind: str, name: str) -> str:
    return f"{KEY_PREFIX}{kind}:{name}"


def interval_s() -> float:
    return float(settings.MERIDIAN["HEARTBEAT_S"])


def stale_after_s() -> float:
    return interval_s() * settings.MERIDIAN["HEARTBEAT_MISSED"]


def this_process(kind: str, name: str, queues: tuple[str, ...] = ()) -> Heartbeat:
    """A heartbeat of the calling process, now."""
    return Heartbeat(kind, name, socket.gethostname(), os.getpid(), tuple(sorted(queues)),
                     time.time())


def record(redis_client: redis.Redis, beat: Heartbeat) -> None:
    """Store `beat`, replacing the record of an earlier process of the same name."""
    ttl_s = int(settings.MERIDIAN["HEARTBEAT_FORGET_AFTER"].total_seconds())
    pipe = redis_client.pipeline(transaction=False)
    pipe.set(beat.key, json.dumps(asdict(beat)), ex=max(ttl_s, 1))
    pipe.sadd(INDEX_KEY, beat.key)
    pipe.execute()


def forget(redis_client: redis.Redis, kind: str, name: str) -> None:
    """Remove a record: its process is stopping in order."""
    pipe = redis_client.pipeline(transaction=False)
    pipe.delete(key_of(kind, name))
    pipe.srem(INDEX_KEY, key_of(kind, name))
    pipe.execute()


def read_all(redis_client: redis.Redis) -> list[Heartbeat]:
    """Every record still kept, by kind and name; index entries whose key expired are
    dropped from the index on the way."""
    keys = sorted(k.decode() if isinstance(k, bytes) else str(k)
                  for k in redis_client.smembers(INDEX_KEY))  # type: ignore[union-attr]
    if not keys:
        return []
    values: list[Any] = redis_client.mget(keys)  # type: ignore[assignment]
    gone = [key for key, value in zip(keys, values, strict=True) if value is None]
    if gone:
        redis_client.srem(INDEX_KEY, *gone)
    found = []
    for value in values:
        if value is None:
            continue
        try:
            data = json.loads(value)
            found.append(Heartbeat(str(data["kind"]), str(data["name"]), str(data["hostname"]),
                                   int(data["pid"]), tuple(data.get("queues") or ()),
                                   float(data["at"])))
        except (ValueError, KeyError, TypeError):
            continue  # a record this version cannot read counts as none
    return sorted(found, key=lambda b: (b.kind, b.name))


def clear(redis_client: redis.Redis) -> None:
    """Every record gone (tests start from none)."""
    keys = list(redis_client.smembers(INDEX_KEY))  # type: ignore[arg-type]
    redis_client.delete(INDEX_KEY, *keys)
