"""Waiting on evidence, not on the clock: one poll loop for the lab, the tests and the benches.

`wait_until(predicate, timeout_s, what)` calls `predicate` until it returns something truthy
and returns that value. The time limit is a backstop for a thing that never happens, never
the expected duration of one that does: when it runs out, the TimeoutError says what was
awaited, for how long, and what the predicate last returned (or raised), so a failure reads
as a sentence instead of an assertion on a bare `False`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(TimeoutError):
    """`what` did not happen within the limit; `last` is the predicate's last answer."""

    def __init__(self, what: str, timeout_s: float, last: object) -> None:
        super().__init__(f"waited {timeout_s:g} s for {what}; last seen: {last!r}")
        self.what = what
        self.last = last


def wait_until(predicate: Callable[[], T | None], timeout_s: float, what: str,
               every_s: float = 0.05, ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Poll `predicate` every `every_s` seconds until it returns a truthy value (returned);
    exceptions of the types in `ignore` count as "not yet" (e.g. OSError while a server
    starts). The predicate is always tried once more after the deadline, so a slow machine
    that makes the last sleep overshoot does not fail a wait whose evidence has arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        expired = time.monotonic() >= deadline
        value, last = _try(predicate, ignore)
        if value is not None:
            return value
        if expired:
            raise WaitTimeout(what, timeout_s, last)
        time.sleep(max(0.0, min(every_s, deadline - time.monotonic())))


async def wait_until_async(predicate: Callable[[], T | None], timeout_s: float, what: str,
                           every_s: float = 0.02,
                           ignore: tuple[type[BaseException], ...] = ()) -> T:
    """`wait_until` inside an event loop: the loop runs (the edge, a fake engine) between
    tries, so a predicate on state that other tasks change sees them change."""
    deadline = time.monotonic() + timeout_s
    while True:
        expired = time.monotonic() >= deadline
        value, last = _try(predicate, ignore)
        if value is not None:
            return value
        if expired:
            raise WaitTimeout(what, timeout_s, last)
        await asyncio.sleep(max(0.0, min(every_s, deadline - time.monotonic())))


def _try(predicate: Callable[[], T | None],
         ignore: tuple[type[BaseException], ...]) -> tuple[T | None, object]:
    """(its value, None) when the predicate answers truthy, else (None, what it answered or
    raised)."""
    try:
        value = predicate()
    except ignore as exc:
        return None, exc
    return (value, None) if value else (None, value)
