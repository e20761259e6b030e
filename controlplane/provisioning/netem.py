"""A delaying TCP relay: network distance between lab regions, without touching data planes.

`python -m controlplane.provisioning.netem --upstream HOST:PORT --listen HOST:PORT=DELAY_MS
[--listen ...]` accepts on each listen address and relays to the upstream, holding every
chunk for DELAY_MS in each direction. Chunks are queued with their due time, so the delay
adds latency without limiting throughput (a reader never waits on a sleeping writer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time
from collections import deque

CHUNK = 64 * 1024


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    queue: deque[tuple[float, bytes]] = deque()
    ready = asyncio.Event()
    done = False

    async def read() -> None:
        nonlocal done
        try:
            while data := await reader.read(CHUNK):
                queue.append((time.monotonic() + delay_s, data))
                ready.set()
        except (ConnectionError, OSError):
            pass
        finally:
            done = True
            ready.set()

    reading = asyncio.create_task(read())
    try:
        while True:
            if not queue:
                if done:
                    break
                ready.clear()
                await ready.wait()
                continue
            due, data = queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            queue.popleft()
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        reading.cancel()
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()


async def _relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                 upstream: tuple[str, int], delay_s: float) -> None:
    try:
        up_r, up_w = await asyncio.open_connection(*upstream)
    except OSError:
        client_w.close()
        return
    await asyncio.gather(_pump(client_r, up_w, delay_s), _pump(up_r, client_w, delay_s))
    for w in (client_w, up_w):
        with contextlib.suppress(Exception):
            w.close()


async def serve(upstream: tuple[str, int], listens: list[tuple[str, int, float]]) -> None:
    servers = []
    for host, port, delay_ms in listens:
        delay_s = delay_ms / 1000.0

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter,
                         delay_s: float = delay_s) -> None:
            await _relay(r, w, upstream, delay_s)

        servers.append(await asyncio.start_server(handle, host, port))
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
    address, _, delay = text.partition("=")
    host, port = _host_port(address)
    return host, port, float(delay or 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m controlplane.provisioning.netem")
    parser.add_argument("--upstream", required=True, type=_host_port)
    parser.add_argument("--listen", required=True, action="append", type=parse_listen,
                        help="HOST:PORT=ONE_WAY_DELAY_MS; repeat for each region")
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.upstream, args.listen))


if __name__ == "__main__":
    main()
