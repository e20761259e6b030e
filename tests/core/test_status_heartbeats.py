"""/api/v1/status/ reads the heartbeats workers and beat record, and never waits on them."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from controlplane.celery import app
from controlplane.core import heartbeats
from controlplane.core.models import Role
from controlplane.core.redis_clients import redis_client

pytestmark = pytest.mark.django_db
QUEUES = ("control", "provision", "batch")


@pytest.fixture(autouse=True)
def no_heartbeats() -> Iterator[None]:
    heartbeats.clear(redis_client())
    yield
    heartbeats.clear(redis_client())


def beat_at(kind: str, name: str, age_s: float, queues: tuple[str, ...] = ()) -> None:
    heartbeats.record(redis_client(), heartbeats.Heartbeat(
        kind, name, "host-a", 4242, queues, time.time() - age_s))


def every_queue_and_beat_fresh() -> None:
    for queue in QUEUES:
        beat_at(heartbeats.WORKER, f"{queue}@host-a", 1.0, (queue,))
    beat_at(heartbeats.BEAT, "beat@host-a", 1.0)


def test_fresh_heartbeats_make_workers_and_beat_ok(make_client):  # type: ignore[no-untyped-def]
    every_queue_and_beat_fresh()
    response = make_client(Role.VIEWER).get("/api/v1/status/")
    body = response.json()
    assert response.status_code == 200
    assert body["celery"] == {"ok": True, "detail": "3 worker(s) fresh"}
    assert body["beat"]["ok"] is True and "beat@host-a" in body["beat"]["detail"]
    assert body["workers"] == ["batch@host-a", "control@host-a", "provision@host-a"]
    described = {b["name"]: b for b in body["heartbeats"]}
    assert described["control@host-a"]["queues"] == ["control"]
    assert described["control@host-a"]["pid"] == 4242
    assert described["control@host-a"]["hostname"] == "host-a"
    assert described["beat@host-a"]["kind"] == "beat"
    assert all(b["ok"] for b in body["heartbeats"])
    assert 0.5 < described["beat@host-a"]["age_s"] < body["stale_after_s"]


def test_a_stale_worker_is_not_ok_and_named(make_client, settings):  # type: ignore[no-untyped-def]
    every_queue_and_beat_fresh()
    stale_s = settings.MERIDIAN["HEARTBEAT_S"] * settings.MERIDIAN["HEARTBEAT_MISSED"]
    beat_at(heartbeats.WORKER, "control2@host-b", stale_s + 30, ("control",))
    body = make_client(Role.VIEWER).get("/api/v1/status/").json()
    assert body["celery"]["ok"] is False
    assert "stale: control2@host-b (last heartbeat" in body["celery"]["detail"]
    assert "control2@host-b" not in body["workers"]
    assert {b["name"]: b["ok"] for b in body["heartbeats"]}["control2@host-b"] is False
    assert body["beat"]["ok"] is True  # one stale worker says nothing about beat


def test_a_stale_beat_is_not_ok_and_named(make_client, settings):  # type: ignore[no-untyped-def]
    every_queue_and_beat_fresh()
    stale_s = settings.MERIDIAN["HEARTBEAT_S"] * settings.MERIDIAN["HEARTBEAT_MISSED"]
    beat_at(heartbeats.BEAT, "beat-celerybeat2-schedule@host-b", stale_s + 1)
    body = make_client(Role.VIEWER).get("/api/v1/status/").json()
    assert body["beat"]["ok"] is False
    assert body["beat"]["detail"].startswith("stale: beat-celerybeat2-schedule@host-b")
    assert body["celery"]["ok"] is True


def test_a_queue_without_a_fresh_worker_is_named(make_client, settings):  # type: ignore[no-untyped-def]
    stale_s = settings.MERIDIAN["HEARTBEAT_S"] * settings.MERIDIAN["HEARTBEAT_MISSED"]
    beat_at(heartbeats.WORKER, "control@host-a", 1.0, ("control",))
    beat_at(heartbeats.WORKER, "provision@host-a", 1.0, ("provision",))
    beat_at(heartbeats.WORKER, "batch@host-a", stale_s + 5, ("batch",))
    detail = make_client(Role.VIEWER).get("/api/v1/status/").json()["celery"]["detail"]
    assert "stale: batch@host-a" in detail and "no fresh worker consumes batch" in detail


def test_no_heartbeat_at_all_is_not_ok(make_client):  # type: ignore[no-untyped-def]
    body = make_client(Role.VIEWER).get("/api/v1/status/").json()
    assert body["celery"] == {"ok": False, "detail": "no worker heartbeat recorded"}
    assert body["beat"] == {"ok": False, "detail": "no beat heartbeat recorded"}
    assert body["workers"] == [] and body["heartbeats"] == []


def test_an_expired_record_leaves_the_index(make_client):  # type: ignore[no-untyped-def]
    every_queue_and_beat_fresh()
    client = redis_client()
    client.delete(heartbeats.key_of(heartbeats.WORKER, "batch@host-a"))  # as its TTL does
    body = make_client(Role.VIEWER).get("/api/v1/status/").json()
    assert "batch@host-a" not in {b["name"] for b in body["heartbeats"]}
    assert not client.sismember(heartbeats.INDEX_KEY,
                                heartbeats.key_of(heartbeats.WORKER, "batch@host-a"))


def test_status_never_broadcasts_to_workers(make_client, monkeypatch):  # type: ignore[no-untyped-def]
    """A broadcast (ping, inspect, any control command) waits out its timeout for replies;
    status must answer from the records alone."""
    calls: list[str] = []

    def refuse(name: str):  # type: ignore[no-untyped-def]
        def called(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(name)
            raise AssertionError(f"status called app.control.{name}")
        return called

    for name in ("ping", "inspect", "broadcast"):
        monkeypatch.setattr(app.control, name, refuse(name))
    every_queue_and_beat_fresh()
    response = make_client(Role.VIEWER).get("/api/v1/status/")
    assert calls == []
    assert response.status_code == 200 and response.json()["celery"]["ok"] is True
