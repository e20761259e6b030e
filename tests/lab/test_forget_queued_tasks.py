"""A lab starts with no Celery message an earlier lab left in its Redis database."""

from __future__ import annotations

from controlplane.core.redis_clients import redis_client
from controlplane.lab.supervisor import forget_queued_tasks


def test_an_earlier_labs_queued_tasks_are_dropped_and_other_keys_kept() -> None:
    client = redis_client()
    client.rpush("provision", b"terminate replica 2")
    client.rpush("control\x06\x163", b"a priority message")
    client.hset("unacked", "tag", "in flight")
    client.set("meridian:other", b"kept")
    try:
        forget_queued_tasks()
        assert not client.exists("provision", "control\x06\x163", "unacked")
        assert client.get("meridian:other") == b"kept"
    finally:
        client.delete("meridian:other")
