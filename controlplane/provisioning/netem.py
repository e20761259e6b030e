"""A delaying TCP relay: network distance between lab regions, without touching data planes.

`python -m controlplane.provisioning.netem --upstream HOST:PORT --listen HOST:PORT=DELAY_MS
[--listen ...]` accepts on each listen address and relays to the upstream, holding every
chunk for DELAY_MS in each direction (so a round trip costs twice DELAY_MS). Each direction
is a reader that stamps chunks with their due time and a writer that releases them when due,
so the delay adds latency without limiting throughput: a reader never waits on a sleeping
writer, and many chunks can be in flight at once, as on a long link.

SIGUSR1 toggles a black hole (a partition): while it lasts nothing is forwarded either way
and nothing is closed or refused — bytes are held (as TCP would retransmit them) and new
connections are accepted but not connected upstream — so a client sees a peer that has gone
silent, not one that has gone away; the next SIGUSR1 heals it and what was held flows on.
Unlike a kernel partition (controlplane/lab/netns.py), the relay's own kernel still acknowledges what it
receives, so to a client it looks like an engine that accepts and never answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections import deque

CHUNK = 64 * 1024
# Bytes a direction may hold before it stops reading: the link's bandwidth-delay product
# for the lab (a few hundred MB/s over a few hundred ms) without unbounded memory.
MAX_IN_FLIGHT = 32 * 1024 * 1024


class Link:
    """Whether the relay forwards (`up` set) or black-holes everything (cleared)."""

    def __init__(self) -> None:
        self.up = asyncio.Event()
        self.up.set()

    @property
    def black_hole(self) -> bool:
        return not self.up.is_set()

    def toggle(self) -> None:
        if self.up.is_set():
            self.up.clear()
        else:
            self.up.set()
        print(f"netem: {'black hole: forwarding nothing' if self.black_hole else 'forwarding'}",
              file=sys.stderr, flush=True)

    async def wait_up(self) -> None:
        if not self.up.is_set():
            await self.up.wait()


class _DelayedDirection:
    """One direction of one connection: stamp on read, release on due time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 delay_s: float, link: Link | None = None) -> None:
        self.reader = reader
        self.writer = writer
        self.delay_s = delay_s
        self.link = link
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued_bytes = 0
        self.eof = False
        self.readable = asyncio.Event()  # something queued, or EOF
        self.room = asyncio.Event()  # below MAX_IN_FLIGHT
        self.room.set()

    async def read(self) -> None:
        try:
            while data := await self.reader.read(CHUNK):
                self.queue.append((time.monotonic() + self.delay_s, data))
                self.queued_bytes += len(data)
                self.readable.set()
                if self.queued_bytes >= MAX_IN_FLIGHT:
                    self.room.clear()
                    await self.room.wait()
        except (ConnectionError, OSError):
            pass
        finally:
            self.eof = True
            self.readable.set()

    async def write(self) -> None:
        try:
            while True:
                if not self.queue:
                    if self.eof:
                        break
                    self.readable.clear()
                    await self.readable.wait()
                    continue
                due, data = self.queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if self.link is not None:
                    await self.link.wait_up()
                self.queue.popleft()
                self.queued_bytes -= len(data)
                if self.queued_bytes < MAX_IN_FLIGHT:
                    self.room.set()
                self.writer.write(data)
                await self.writer.drain()
            # Pass the half-close on, so request/response protocols see the end of input.
            if self.writer.can_write_eof():
                self.writer.write_eof()
        except (ConnectionError, OSError):
            pass

    async def run(self) -> None:
        reading = asyncio.create_task(self.read())
        try:
            await self.write()
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading


async def relay_connection(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                           upstream: tuple[str, int], delay_s: float,
                           link: Link | None = None) -> None:
    if link is not None:
        await link.wait_up()
    try:
        up_r, up_w = await asyncio.open_connection(*upstream)
    except OSError:
        client_w.close()
        return
    try:
        await asyncio.gather(_DelayedDirection(client_r, up_w, delay_s, link).run(),
                             _DelayedDirection(up_r, client_w, delay_s, link).run())
    finally:
        for w in (client_w, up_w):
            with contextlib.suppress(Exception):
                w.close()


async def serve(upstream: tuple[str, int], listens: list[tuple[str, int, float]],
                stop: asyncio.Event | None = None, link: Link | None = None) -> None:
    """Relay until `stop` is set (or SIGTERM/SIGINT when run as a process; SIGUSR1 toggles
    the black hole)."""
    servers = []
    if link is None:
        link = Link()
        if stop is None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, link.toggle)
    for host, port, delay_ms in listens:
        delay_s = delay_ms / 1000.0

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter,
                         delay_s: float = delay_s) -> None:
            await relay_connection(r, w, upstream, delay_s, link)

        servers.append(await asyncio.start_server(handle, host, port))
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def parse_listen(text: str) -> tuple[str, int, float]:
    """`HOST:PORT=DELAY_MS` (delay optional, one way) as (host, port, delay_ms)."""
    address, _, delay = text.partition("=")
    host, port = _host_port(address)
    delay_ms = float(delay or 0)
    if delay_ms < 0:
        raise argparse.ArgumentTypeError(f"negative delay in {text!r}")
    return host, port, delay_ms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m controlplane.provisioning.netem")
    parser.add_argument("--upstream", required=True, type=_host_port)
    parser.add_argument("--listen", required=True, action="append", type=parse_listen,
                        help="HOST:PORT=ONE_WAY_DELAY_MS; repeat for each region")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.upstream, args.listen))
    else:
        uvloop.run(serve(args.upstream, args.listen))


if __name__ == "__main__":
    main()
