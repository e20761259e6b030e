"""The fallback to pushes: poll the control plane for this edge's table with If-None-Match.

`GET {control plane}/api/v1/edges/{name}/table` answers 304 while the table's hash is the
one the edge serves. A new table goes through the same acceptance as a push (signature, edge
name, newer version, persisted before it is served), so the pull adds no way around them.
Failures back off exponentially up to a minute; the edge keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import TYPE_CHECKING
from urllib.parse import quote

from edge.background import stop_task
from edge.table import parse_origin
from edge.upstream import UpstreamError

if TYPE_CHECKING:
    from edge.server import Edge

log = logging.getLogger("meridian.edge.pull")

MAX_BACKOFF_S = 60.0


class TablePuller:
    def __init__(self, edge: Edge, base_url: str, token: str | None,
                 interval_s: float = 15.0, timeout_s: float = 10.0) -> None:
        self.edge = edge
        self.origin = parse_origin(base_url, "--control-plane")
        self.path = f"/api/v1/edges/{quote(edge.name, safe='')}/table"
        self.token = token
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="edge-pull")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def pull_once(self) -> str:
        """One poll; returns "updated", "unchanged", or "refused: …" (raises on no answer)."""
        headers = b"accept: application/json\r\n"
        table = self.edge.table
        if table is not None:
            headers += b'if-none-match: "%s"\r\n' % table.hash.encode()
        if self.token:
            headers += b"authorization: Bearer %s\r\n" % self.token.encode()
        status, _, body = await self.edge.pool.fetch(self.origin, "GET", self.path,
                                                     self.timeout_s, headers)
        if status == 304:
            return "unchanged"
        if status != 200:
            raise UpstreamError(f"the control plane answered {status}: {body[:200]!r}")
        answer = await self.edge.accept_table(body, "pull")
        if answer.status == 200:
            return "updated"
        if answer.status == 409:
            return "unchanged"
        message = answer.body.get("error", {}).get("message", "")
        log.error("pulled table refused (%d): %s", answer.status, message)
        return f"refused: {message}"

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                outcome = await self.pull_once()
                failures = 0
                if outcome == "updated":
                    log.info("pulled table v%s", self.edge.table and self.edge.table.version)
            except asyncio.CancelledError:
                raise
            except (UpstreamError, OSError) as exc:
                failures += 1
                log.warning("table pull failed (%d in a row): %s", failures, exc)
            pause = self.interval_s if not failures else min(
                MAX_BACKOFF_S, self.interval_s * 2 ** (failures - 1))
            await asyncio.sleep(pause * random.uniform(0.8, 1.2))
