"""What the edge adds to a request, side by side with going direct and with nginx.

The same load goes to one upstream three ways: direct, through a Meridian edge (a real
`python -m edge` child with a signed table, its access log on), and through nginx as a plain
reverse proxy (keep-alive upstream, buffering off, one worker like the edge's one process)
when `nginx` is on PATH. The upstream is a minimal HTTP/1.1 server inside this file that
answers like vLLM (a chat completion JSON, or an SSE stream of 20 events 1 ms apart) with no
model behind it, so every microsecond measured is HTTP and proxy work. The load generator is
a raw asyncio client with keep-alive connections, in this process.

Measured: latency at 1 concurrent request (targets interleaved request by request, so drift
on a shared machine hits all three alike) and at 32 (rounds alternating between targets);
requests per second for JSON and streams per second for SSE at 32, and at 32 the CPU each
proxy process spent per JSON request (the kernel's own count, /proc/<pid>/schedstat: far
steadier than requests/s on a shared machine, where the load generator and the upstream
compete for the same cores). "Added" latency is a proxy's percentile minus direct's. The edge's table lists two replicas (the same upstream
under two ids; `--replicas`), so its whole scheduling pipeline, prefix hashing included, runs
on every request, as do authentication, the tenant's rate limits, metrics and the access log.
When the edge's request path is compiled (`tools/build_edge.py`, run by `make setup`), the
same edge run from source (`MERIDIAN_EDGE_PURE=1`) is measured beside it on JSON as
"edge-source", so the JSON shows what compiling buys (`compiled_rps_ratio_vs_source`).

    python bench/edge_overhead.py --quick
    python bench/edge_overhead.py --smoke   (every step, not the figures)

prints progress to stderr and one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httptools  # noqa: E402

from controlplane.lab.engines import stop_all  # noqa: E402
from controlplane.lab.processes import die_with_parent  # noqa: E402
from controlplane.lab.waiting import WaitTimeout, wait_until  # noqa: E402
from edge import BUILD  # noqa: E402
from edge.local import LocalEdge, build_table, free_port, replica_entry  # noqa: E402

API_KEY = "sk-bench-edge-overhead"
MODEL = "bench-model"
SYSTEM = ("You are a concise assistant for a logistics company. Answer in one sentence, and "
          "never reveal internal tooling.")
REQUEST_JSON = json.dumps({
    "model": MODEL, "max_tokens": 16,
    "messages": [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": "Say hello in one short sentence."}],
}).encode()
REQUEST_SSE = json.dumps({
    "model": MODEL, "max_tokens": 16, "stream": True,
    "messages": [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": "Say hello in one short sentence."}],
}).encode()
RESPONSE_JSON = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1767225600,
    "model": MODEL, "choices": [{"index": 0, "message": {
        "role": "assistant", "content": "Hello there, how can I help you today?"},
        "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 38, "completion_tokens": 10, "total_tokens": 48},
}, separators=(",", ":")).encode()
SSE_EVENTS = 20
# What every run's JSON line holds (tests/bench/test_benchmarks.py checks it at --smoke).
RESULT_KEYS = ("added_p50_ms_c1", "added_p99_ms_c1", "added_p50_ms_c32", "added_p99_ms_c32",
               "rps_ratio_vs_direct", "rps_ratio_vs_nginx", "sse_rps_ratio_vs_nginx",
               "sse_added_ttft_p50_ms_c1", "compiled_rps_ratio_vs_source",
               "edge_cpu_us_per_request", "nginx_cpu_us_per_request", "cpu_ratio_vs_nginx",
               "errors", "detail", "smoke", "seconds", "upstream", "edge_replicas",
               "edge_build", "cpus")


def sse_events() -> list[bytes]:
    def chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
        return b"data: " + json.dumps({
            "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1767225600,
            "model": MODEL, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}],
        }, separators=(",", ":")).encode() + b"\n\n"
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": f" tok{i}"}) for i in range(SSE_EVENTS - 3)]
    events += [chunk({}, "stop"), b"data: [DONE]\n\n"]
    return events


# --- the upstream: answers like vLLM's OpenAI server, with nothing behind it -------------------

class UpstreamProtocol(asyncio.Protocol):
    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.url = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_message_begin(self) -> None:
        self.body = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        body = b"".join(self.body)
        if self.url == b"/health":
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        elif self.url == b"/metrics":
            text = b"vllm:num_requests_waiting{model_name=\"m\"} 0\n"
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(text), text))
        elif b'"stream": true' in body or b'"stream":true' in body:
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; "
                                 b"charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n")
            asyncio.get_running_loop().create_task(self.stream())
        else:
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(RESPONSE_JSON),
                                                                     RESPONSE_JSON))

    async def stream(self) -> None:
        for event in EVENTS:
            await asyncio.sleep(self.gap_s)
            if self.transport is None or self.transport.is_closing():
                return
            self.transport.write(b"%x\r\n%s\r\n" % (len(event), event))
        if self.transport is not None:
            self.transport.write(b"0\r\n\r\n")

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


EVENTS = sse_events()


def serve_upstream(port: int, gap_s: float) -> None:
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: UpstreamProtocol(gap_s), "127.0.0.1", port,
                                          backlog=1024)
        print("READY", flush=True)
        await server.serve_forever()

    uvloop.run(main())


# --- the load generator -----------------------------------------------------------------------

class ClientConnection(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, float, bytes]] | None = None
        self.first_at = 0.0
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if not self.first_at:
            self.first_at = time.perf_counter()
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), self.first_at,
                                    b"".join(self.body)))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"closed: {exc}"))

    async def request(self, data: bytes) -> tuple[int, float, float, bytes]:
        """(status, seconds to first body byte, seconds to the end, body)."""
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.first_at = 0.0
        self.body = []
        started = time.perf_counter()
        self.transport.write(data)
        status, first_at, body = await self.waiter
        return status, first_at - started, time.perf_counter() - started, body


def request_bytes(port: int, body: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
            b"authorization: Bearer %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (port, API_KEY.encode(), len(body), body))


def cpu_seconds(pids: list[int]) -> float:
    """CPU time the processes have run, user and kernel, to the nanosecond."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def worker_pids(pid: int) -> list[int]:
    """A process and its children (nginx's workers answer, not its master)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [pid, *(int(c) for c in f.read().split())]
    except OSError:
        return [pid]


class Target:
    def __init__(self, name: str, port: int, pids: list[int] | None = None) -> None:
        self.name = name
        self.port = port
        self.pids = pids or []  # the proxy's processes, whose CPU per request is measured
        self.json = request_bytes(port, REQUEST_JSON)
        self.sse = request_bytes(port, REQUEST_SSE)

    async def connect(self, n: int) -> list[ClientConnection]:
        loop = asyncio.get_running_loop()
        conns = []
        for _ in range(n):
            _, conn = await loop.create_connection(ClientConnection, "127.0.0.1", self.port)
            conns.append(conn)
        return conns


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Result:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.ttfb: list[float] = []
        self.completed = 0
        self.errors = 0
        self.seconds = 0.0
        self.cpu_s = 0.0  # CPU the target's processes spent over the counted seconds

    @property
    def rate(self) -> float:
        return self.completed / self.seconds if self.seconds else 0.0


def check(status: int, body: bytes, sse: bool) -> bool:
    if status != 200:
        return False
    return body.endswith(b"data: [DONE]\n\n") if sse else body == RESPONSE_JSON


async def interleaved_c1(targets: list[Target], n: int, sse: bool) -> dict[str, Result]:
    conns = {t.name: (await t.connect(1))[0] for t in targets}
    results = {t.name: Result() for t in targets}
    for i in range(n + n // 10):
        for target in targets:
            status, ttfb, total, body = await conns[target.name].request(
                target.sse if sse else target.json)
            if i < n // 10:
                continue  # warm-up
            result = results[target.name]
            if not check(status, body, sse):
                result.errors += 1
            result.latencies.append(total)
            result.ttfb.append(ttfb)
            result.completed += 1
    for conn in conns.values():
        assert conn.transport is not None
        conn.transport.close()
    return results


async def closed_loop(target: Target, concurrency: int, seconds: float, sse: bool,
                      result: Result) -> None:
    conns = await target.connect(concurrency)
    payload = target.sse if sse else target.json
    stop_at = time.perf_counter() + seconds

    async def worker(conn: ClientConnection) -> None:
        while time.perf_counter() < stop_at:
            status, ttfb, total, body = await conn.request(payload)
            if not check(status, body, sse):
                result.errors += 1
            result.latencies.append(total)
            result.ttfb.append(ttfb)
            result.completed += 1

    # A short warm-up on the same connections, not counted.
    for conn in conns:
        await conn.request(payload)
    started = time.perf_counter()
    stop_at = started + seconds
    cpu_before = cpu_seconds(target.pids)
    await asyncio.gather(*(worker(c) for c in conns))
    result.seconds += time.perf_counter() - started
    result.cpu_s += cpu_seconds(target.pids) - cpu_before
    for conn in conns:
        assert conn.transport is not None
        conn.transport.close()


async def rounds(targets: list[Target], concurrency: int, seconds: float, n_rounds: int,
                 sse: bool) -> dict[str, Result]:
    results = {t.name: Result() for t in targets}
    for r in range(n_rounds):
        order = targets if r % 2 == 0 else list(reversed(targets))
        for target in order:
            await closed_loop(target, concurrency, seconds, sse, results[target.name])
    return results


# --- orchestration ----------------------------------------------------------------------------

NGINX_CONF = """
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log {dir}/access.log combined buffer=64k flush=1s;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  keepalive_requests 1000000;
  upstream engine {{ server 127.0.0.1:{upstream}; keepalive 128; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""


def log(message: str) -> None:
    print(f"[edge_overhead] {message}", file=sys.stderr, flush=True)


def start_upstream(gap_s: float) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve-upstream", str(port), "--sse-gap-ms",
         str(gap_s * 1000)], stdout=subprocess.PIPE, preexec_fn=die_with_parent())
    assert process.stdout is not None
    line = process.stdout.readline()
    if b"READY" not in line:
        raise RuntimeError("the upstream did not start")
    return process, port


def start_nginx(upstream_port: int, workdir: Path) -> tuple[subprocess.Popen[bytes], int] | None:
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx")
                                      else None)
    if nginx is None:
        return None
    port = free_port()
    conf = workdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=workdir, upstream=upstream_port, port=port))
    # SIGTERM, not SIGKILL, so that nginx's master stops its workers too.
    process = subprocess.Popen([nginx, "-c", str(conf), "-p", str(workdir)],
                               stderr=subprocess.DEVNULL,
                               preexec_fn=die_with_parent(signal.SIGTERM))
    def listening() -> bool:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True

    try:
        wait_until(listening, 10.0, f"nginx to listen on port {port}", ignore=(OSError,))
    except WaitTimeout:
        stop_all([process])
        return None
    return process, port


def summary(results: dict[str, Result]) -> dict[str, dict[str, float]]:
    return {name: {
        "p50_ms": round(percentile(r.latencies, 0.50) * 1000, 4),
        "p99_ms": round(percentile(r.latencies, 0.99) * 1000, 4),
        "ttfb_p50_ms": round(percentile(r.ttfb, 0.50) * 1000, 4),
        "per_s": round(r.rate, 1),
        "requests": r.completed,
        "errors": r.errors,
        "cpu_us_per_request": round(r.cpu_s / r.completed * 1e6, 2),  # 0: not measured
    } for name, r in results.items() if r.completed}


def added(s: dict[str, dict[str, float]], proxy: str, key: str) -> float | None:
    if proxy not in s:
        return None
    return round(s[proxy][key] - s["direct"][key], 4)


def ratio(s: dict[str, dict[str, float]], a: str, b: str, key: str = "per_s") -> float | None:
    if a not in s or b not in s or not s[a].get(key) or not s[b].get(key):
        return None
    return round(s[a][key] / s[b][key], 3)


async def measure(targets: list[Target], quick: bool, smoke: bool = False
                  ) -> dict[str, object]:
    n_c1 = 100 if smoke else 1500 if quick else 5000
    seconds, n_rounds = (0.2, 2) if smoke else (0.5, 6) if quick else (2.0, 8)
    names = ", ".join(t.name for t in targets)
    # The edge run from source is measured on JSON only, where the two builds differ.
    streams = [t for t in targets if t.name != "edge-source"]
    log(f"JSON, 1 concurrent, {n_c1} requests each, interleaved: {names}")
    json_c1 = summary(await interleaved_c1(targets, n_c1, sse=False))
    log(f"  {json_c1}")
    log(f"JSON, 32 concurrent, {n_rounds} rounds of {seconds}s each")
    json_c32 = summary(await rounds(targets, 32, seconds, n_rounds, sse=False))
    log(f"  {json_c32}")
    log(f"SSE ({SSE_EVENTS} events), 1 concurrent, interleaved")
    sse_c1 = summary(await interleaved_c1(streams, n_c1 // 20, sse=True))
    log(f"  {sse_c1}")
    log(f"SSE, 32 concurrent streams, {n_rounds} rounds of {seconds}s each")
    sse_c32 = summary(await rounds(streams, 32, seconds, n_rounds, sse=True))
    log(f"  {sse_c32}")
    errors = sum(r["errors"] for s in (json_c1, json_c32, sse_c1, sse_c32) for r in s.values())
    return {
        "added_p50_ms_c1": added(json_c1, "edge", "p50_ms"),
        "added_p99_ms_c1": added(json_c1, "edge", "p99_ms"),
        "added_p50_ms_c32": added(json_c32, "edge", "p50_ms"),
        "added_p99_ms_c32": added(json_c32, "edge", "p99_ms"),
        "rps_ratio_vs_direct": ratio(json_c32, "edge", "direct"),
        "rps_ratio_vs_nginx": ratio(json_c32, "edge", "nginx"),
        "sse_rps_ratio_vs_nginx": ratio(sse_c32, "edge", "nginx"),
        "sse_rps_ratio_vs_direct": ratio(sse_c32, "edge", "direct"),
        "sse_added_ttft_p50_ms_c1": added(sse_c1, "edge", "ttfb_p50_ms"),
        "nginx_added_p50_ms_c1": added(json_c1, "nginx", "p50_ms"),
        "nginx_added_p99_ms_c1": added(json_c1, "nginx", "p99_ms"),
        "nginx_added_p50_ms_c32": added(json_c32, "nginx", "p50_ms"),
        "nginx_added_p99_ms_c32": added(json_c32, "nginx", "p99_ms"),
        "nginx_rps_ratio_vs_direct": ratio(json_c32, "nginx", "direct"),
        "source_rps_ratio_vs_nginx": ratio(json_c32, "edge-source", "nginx"),
        "source_added_p50_ms_c1": added(json_c1, "edge-source", "p50_ms"),
        "compiled_rps_ratio_vs_source": ratio(json_c32, "edge", "edge-source"),
        "edge_cpu_us_per_request": json_c32.get("edge", {}).get("cpu_us_per_request") or None,
        "nginx_cpu_us_per_request": json_c32.get("nginx", {}).get("cpu_us_per_request") or None,
        "source_cpu_us_per_request": json_c32.get("edge-source", {}).get(
            "cpu_us_per_request") or None,
        "cpu_ratio_vs_nginx": ratio(json_c32, "edge", "nginx", "cpu_us_per_request"),
        "compiled_cpu_ratio_vs_source": ratio(json_c32, "edge", "edge-source",
                                              "cpu_us_per_request"),
        "errors": errors,
        "detail": {"json_c1": json_c1, "json_c32": json_c32, "sse_c1": sse_c1,
                   "sse_c32": sse_c32},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run of about 30 seconds")
    parser.add_argument("--smoke", action="store_true",
                        help="a few hundred requests per target: every step, not the figures")
    parser.add_argument("--no-nginx", action="store_true")
    parser.add_argument("--replicas", type=int, default=2,
                        help="replica entries in the edge's table, all for the one upstream")
    parser.add_argument("--sse-gap-ms", type=float, default=1.0,
                        help="pause before each SSE event at the upstream")
    parser.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream, args.sse_gap_ms / 1000)
        return 0

    import uvloop

    started = time.monotonic()
    processes: list[subprocess.Popen[bytes]] = []
    workdir = Path(tempfile.mkdtemp(prefix="meridian-bench-"))
    edge = LocalEdge(name="edge-bench", extra_args=["--probe-interval", "1"],
                     preexec_fn=die_with_parent())
    # The same edge run from source beside the compiled one, when there is a compiled one.
    source_edge = (LocalEdge(name="edge-bench-source", extra_args=["--probe-interval", "1"],
                             env={"MERIDIAN_EDGE_PURE": "1"}, preexec_fn=die_with_parent())
                   if BUILD.native else None)
    edges = [edge] if source_edge is None else [edge, source_edge]
    try:
        upstream, upstream_port = start_upstream(args.sse_gap_ms / 1000)
        processes.append(upstream)
        log(f"upstream (in-file, vLLM-shaped answers) on 127.0.0.1:{upstream_port}")
        url = f"http://127.0.0.1:{upstream_port}"
        for e in edges:
            e.start()
            e.push(build_table(1, e.name, {MODEL: [
                replica_entry(f"bench-r{i + 1}", url, max_inflight=1024)
                for i in range(args.replicas)
            ]}, {API_KEY: {"tenant": "bench", "jurisdictions": ["EU"], "rpm": 100_000_000,
                           "tpm": 1_000_000_000, "models": ["*"], "tier": "interactive"}}))
        log(f"edge on {edge.url}, request path {BUILD.detail} (access log {edge.access_log})")
        targets = [Target("direct", upstream_port),
                   Target("edge", edge.port, [edge.process.pid] if edge.process else [])]
        if source_edge is not None:
            log(f"edge-source on {source_edge.url}: the same edge run from source")
            targets.append(Target("edge-source", source_edge.port, [source_edge.process.pid]
                                  if source_edge.process else []))
        nginx = None if args.no_nginx else start_nginx(upstream_port, workdir)
        if nginx is not None:
            processes.append(nginx[0])
            targets.append(Target("nginx", nginx[1], worker_pids(nginx[0].pid)))
            log(f"nginx (1 worker, keep-alive upstream, buffering off) on 127.0.0.1:{nginx[1]}")
        else:
            log("nginx not found (or --no-nginx): no nginx comparison")
        result = uvloop.run(measure(targets, args.quick, args.smoke))
    finally:
        for e in edges:
            e.close()
        stop_all(processes)
        shutil.rmtree(workdir, ignore_errors=True)
    result["smoke"] = args.smoke
    result["seconds"] = round(time.monotonic() - started, 1)
    result["upstream"] = "in-file minimal HTTP/1.1 server with vLLM-shaped answers"
    result["edge_replicas"] = args.replicas
    result["edge_build"] = BUILD.detail
    result["cpus"] = os.cpu_count()
    log(f"done in {result['seconds']}s")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
