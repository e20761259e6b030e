"""The edge's background loops (table pulls, health probes, the first-byte check): stopping one."""

from __future__ import annotations

import asyncio


async def stop_task(task: asyncio.Task[None] | None) -> None:
    """Cancel a background loop's task and wait until it has ended; None: nothing runs."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
