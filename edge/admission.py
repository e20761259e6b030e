"""Backpressure: a bounded wait for capacity when every candidate is at its in-flight limit.

A request that finds all its candidates full waits here, per model, until a slot frees or its
tier's deadline passes (then 503); when the queue is full it is refused at once (429), so
overload turns into quick answers rather than a pile of open connections. Interactive
waiters are woken before batch ones, and batch requests yield while interactive ones wait.
"""

from __future__ import annotations

import asyncio
from collections import deque

Waiters = deque[asyncio.Future[bool]]


class CapacityQueue:
    def __init__(self, max_waiting: int = 512) -> None:
        self.max_waiting = max_waiting
        self.waiting = 0
        # per model: (interactive waiters, batch waiters)
        self._waiters: dict[str, tuple[Waiters, Waiters]] = {}

    @property
    def full(self) -> bool:
        return self.waiting >= self.max_waiting

    def interactive_waiting(self, model: str) -> bool:
        queues = self._waiters.get(model)
        return bool(queues and queues[0])

    async def wait(self, model: str, tier: str, timeout_s: float) -> bool:
        """Wait for a slot of `model` to free; False when `timeout_s` passed first."""
        if timeout_s <= 0:
            return False
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        queues = self._waiters.get(model)
        if queues is None:
            queues = self._waiters[model] = (deque(), deque())
        queue = queues[0] if tier == "interactive" else queues[1]
        queue.append(future)
        self.waiting += 1
        timer = loop.call_later(timeout_s, _resolve, future, False)
        try:
            return await future
        finally:
            timer.cancel()
            self.waiting -= 1
            try:
                queue.remove(future)
            except ValueError:
                pass
            if not queues[0] and not queues[1] and self._waiters.get(model) is queues:
                del self._waiters[model]

    def notify(self, model: str) -> None:
        """A slot of `model` may have freed: wake its waiters, interactive ones first.

        Every waiter re-runs the scheduler (a freed slot may suit one tenant's residency and
        not another's); the first to run takes the slot, the rest wait again.
        """
        queues = self._waiters.get(model)
        if queues is None:
            return
        for queue in queues:
            while queue:
                _resolve(queue.popleft(), True)

    def notify_all(self) -> None:
        for model in list(self._waiters):
            self.notify(model)


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)
