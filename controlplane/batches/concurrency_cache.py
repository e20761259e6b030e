"""What a batch's runners learnt about its concurrency (the number of lines sent at once,
the TTFT baseline: `concurrency`), kept in Redis so that a worker that starts again, or
another one, goes on from it. A cache: when Redis cannot be read or written the runner
starts afresh, and the batch runs all the same."""

from __future__ import annotations

import json
import logging
from typing import TypedDict

from controlplane.core.redis_clients import redis_client

log = logging.getLogger(__name__)
# How long a batch's entry is kept after its last write (a batch's completion window).
KEEP_S = 24 * 3600


class Learnt(TypedDict):
    n: int  # lines sent at once
    ttft_baseline_s: float | None  # the target replicas' TTFT p95 before the batch, or lower


def _key(batch_id: str) -> str:
    return f"meridian:batches:concurrency:{batch_id}"


def load_concurrency(batch_id: str) -> Learnt | None:
    """What the batch's runners learnt so far; None when nothing is kept (or Redis cannot
    be read)."""
    try:
        raw = redis_client().get(_key(batch_id))
    except Exception:  # noqa: BLE001 - a cache: the batch runs without it
        log.warning("cannot read batch %s's concurrency", batch_id, exc_info=True)
        return None
    if not raw or not isinstance(raw, (str, bytes)):
        return None
    found: Learnt = json.loads(raw)
    return found


def save_concurrency(batch_id: str, state: Learnt | None) -> None:
    """Keep what was learnt; None forgets it (the batch has finished)."""
    try:
        client = redis_client()
        if state is None:
            client.delete(_key(batch_id))
        else:
            client.set(_key(batch_id), json.dumps(state), ex=KEEP_S)
    except Exception:  # noqa: BLE001 - a cache: the batch runs without it
        log.warning("cannot keep batch %s's concurrency", batch_id, exc_info=True)
