"""Postgres advisory locks so that periodic loops never run twice at once across workers."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection

LOCK_POLL_S = 0.02


def lock_id(name: str) -> int:
    """A stable signed 64-bit id for a lock name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


@contextmanager
def advisory_lock(name: str, wait_s: float = 0.0) -> Iterator[bool]:
    """Try to take a session-level advisory lock; yields whether it was taken.

    With `wait_s`, keeps trying that long before giving up (for work that must follow the
    holder's rather than be dropped)."""
    key = lock_id(name)
    deadline = time.monotonic() + wait_s
    while True:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
            acquired = bool(cursor.fetchone()[0])
        if acquired or time.monotonic() >= deadline:
            break
        time.sleep(LOCK_POLL_S)
    try:
        yield acquired
    finally:
        if acquired:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
