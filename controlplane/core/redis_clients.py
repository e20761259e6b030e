"""One Redis client per URL and timeout in each process, for the control plane's own keys
(heartbeats, locks' companions, caches): no Django models, so the Celery app can use it as
it loads."""

from __future__ import annotations

import redis
from django.conf import settings

_clients: dict[tuple[str, float], redis.Redis] = {}


def redis_client(url: str | None = None, timeout_s: float = 1.0) -> redis.Redis:
    """A client of `url` (REDIS_URL by default), one per URL and timeout in each process:
    its pool keeps connections open between calls (and starts afresh in a forked child)."""
    url = url or settings.REDIS_URL
    if url.startswith("redis+socket://"):
        url = "unix://" + url.removeprefix("redis+socket://")
    client = _clients.get((url, timeout_s))
    if client is None:
        client = _clients.setdefault((url, timeout_s), redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s))
    return client
