"""A region dies under load: what clients see, and how fast each layer of Meridian reacts.

Starts the whole lab (`python -m controlplane.lab`: control plane, workers, beat, three local
regions with two enginesim replicas each, two edges) against a database and Redis database
of its own, then runs two drills under a steady, bounded load of streaming and non-streaming
chat requests sent through an edge:

1. normal: every replica of the edge's own region is killed (SIGKILL of engine and relay,
   through the drill API), with the edge's passive ejection as shipped;
2. no_ejection: the same in the other edge's region, after the routing policy has set
   `eject_after_failures` to its maximum (100), so passive ejection never fires; the edge's
   active /health probes and the control plane's failover remain.

Per run: requests that failed at the client before their first byte (must be zero) and
streams cut mid-way, seconds from the kill to the last client error, to tables without the
region on every edge (polled from each edge's /admin/replicas), and to replacements ready
(the incident's timeline); TTFT p95 before the kill, until the replacements are ready, and
after.

With `--fault partition` the region is cut off instead of killed: every lab region's engines
and relays run in a Linux network namespace of their own (`MERIDIAN_LAB_NETNS`, made here as
controlplane/lab/netns.py makes them, as root), and the drill sets the region's end of its veth link
down, so its packets are dropped and nothing is reset or refused — the engines keep running,
unreachable. The control plane finds out by its probes timing out, the edge by its connect,
dead-peer, first-byte and per-token timeouts. Where namespaces cannot be made (not root, no
`ip`), the region's relays are black-holed instead (SIGUSR1: they stop forwarding and hold
every byte, though their own kernel still acknowledges, so the edge sees hung engines rather
than a silent network); `partitioned_by` in the JSON says which. SIGSTOP of the engines
would not be a partition either: their kernel would still acknowledge every packet.

With `--engine vllm` the lab serves SmolLM2-135M-Instruct from real vLLM engines (the CPU
build from `make engine`, one core each): two regions with one engine each, so no more than
two real engines run at once (the killed one's replacement starts once it is dead). Only the
first drill runs: the second would kill the region holding every engine left.

    python bench/failover.py [--quick | --smoke] [--engine vllm] [--fault kill|partition]
        [--lab FILE]

`--smoke` (one replica per region, the first drill only, a second of load either side of
it, no wait for a real engine's replacement) checks that every step runs, not the figures;
`--lab FILE` drives a running lab instead of starting one (controlplane.lab.child_lab).

Progress on stderr; one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controlplane.lab import netns  # noqa: E402
from controlplane.lab.child_lab import (  # noqa: E402
    Lab,
    add_lab_option,
    api,
    edge_replicas,
    iso_time,
    running_lab,
    wait_ready,
)

# What every run's JSON line holds (tests/bench/test_benchmarks.py checks it at --smoke).
RESULT_KEYS = ("benchmark", "engine", "quick", "smoke", "fault", "partitioned_by",
               "concurrency", "requests", "failed_before_first_byte", "streams_cut",
               "streams_resumed", "resumed_text_ok", "s_to_last_error", "s_to_tables_pushed",
               "s_to_region_down", "s_to_replacement_ready", "ttft_p95_s", "runs", "targets")
# Its smoke run can drive a lab another process started (--lab) with the lab's defaults.
# `--smoke --engine vllm` runs too, but starts a lab of real engines (minutes: two vLLM
# starts), so the smoke test leaves it out.
SMOKE_LAB: dict[str, object] = {}
# The lab's served model name per engine (controlplane.lab.fleet.FLEETS).
MODELS = {"enginesim": "llama-3.1-8b", "vllm": "smollm2-135m-instruct"}
# Replicas per region: real engines take a core each, and the machine has two.
REPLICAS_PER_REGION = {"enginesim": 2, "vllm": 1}
# The lab's regions, in the order it starts them (controlplane.lab.regions.LAB_REGIONS).
LAB_REGION_KEYS = ("local:eu-frankfurt", "local:us-virginia", "local:ap-tokyo")


def log(message: str) -> None:
    print(f"[failover] {message}", file=sys.stderr, flush=True)


# -- load -------------------------------------------------------------------------------------

@dataclass
class Outcome:
    started: float
    stream: bool
    first_byte: float | None = None
    ended: float = 0.0
    ok: bool = False
    detail: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    text: str = ""  # what a stream delivered, its content deltas joined

    @property
    def failed_before_first_byte(self) -> bool:
        return not self.ok and self.first_byte is None

    @property
    def cut(self) -> bool:
        return not self.ok and self.first_byte is not None


@dataclass
class Load:
    url: str
    key: str
    concurrency: int
    model: str = MODELS["enginesim"]
    outcomes: list[Outcome] = field(default_factory=list)
    running: bool = True

    async def one(self, session: aiohttp.ClientSession, i: int) -> None:
        stream = i % 2 == 0
        body = {"model": self.model, "max_tokens": 24, "stream": stream,
                "messages": [{"role": "user", "content": f"request {i}: say something"}]}
        body["temperature"] = 0
        outcome = Outcome(time.time(), stream, body=body)
        try:
            async with session.post(f"{self.url}/v1/chat/completions", json=body,
                                    headers={"Authorization": f"Bearer {self.key}"},
                                    timeout=aiohttp.ClientTimeout(total=30)) as response:
                if response.status != 200:
                    outcome.detail = f"HTTP {response.status}: {(await response.text())[:120]}"
                elif stream:
                    done = False
                    raw = bytearray()
                    async for chunk in response.content.iter_any():
                        if outcome.first_byte is None:
                            outcome.first_byte = time.time()
                        raw.extend(chunk)
                        done = done or b"[DONE]" in chunk
                    outcome.ok = done
                    outcome.text = stream_text(bytes(raw))
                    outcome.detail = "" if done else "stream ended without [DONE]"
                else:
                    payload = await response.read()
                    outcome.first_byte = time.time()
                    outcome.ok = b'"choices"' in payload
                    outcome.detail = "" if outcome.ok else payload[:120].decode(errors="replace")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            outcome.detail = f"{type(exc).__name__}: {exc}"[:160]
        outcome.ended = time.time()
        self.outcomes.append(outcome)

    async def worker(self, session: aiohttp.ClientSession, w: int) -> None:
        i = w
        while self.running:
            await self.one(session, i)
            i += self.concurrency

    async def run(self, stop: asyncio.Event) -> None:
        connector = aiohttp.TCPConnector(limit=self.concurrency * 2)
        async with aiohttp.ClientSession(connector=connector) as session:
            tasks = [asyncio.create_task(self.worker(session, w)) for w in range(self.concurrency)]
            await stop.wait()
            self.running = False
            await asyncio.gather(*tasks)


def stream_text(raw: bytes) -> str:
    """The content a chat stream delivered (its deltas joined), from the SSE bytes."""
    text = []
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[len(b"data: "):])
        for choice in event.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


async def answers_match(load: Load, streams: list[Outcome]) -> bool | None:
    """Each stream's text equals the engine's answer to the same request asked again, whole and
    undisturbed (temperature 0: the engine's deterministic output); None with nothing to check."""
    if not streams:
        return None
    async with aiohttp.ClientSession() as session:
        for outcome in streams:
            async with session.post(f"{load.url}/v1/chat/completions",
                                    json={**outcome.body, "stream": False},
                                    headers={"Authorization": f"Bearer {load.key}"},
                                    timeout=aiohttp.ClientTimeout(total=60)) as response:
                answer = await response.json()
            if answer["choices"][0]["message"]["content"] != outcome.text:
                return False
    return True


def resumptions(admin_urls: list[str]) -> float:
    """Streams the edges resumed so far, from their meridian_edge_stream_resumptions_total."""
    total = 0.0
    for admin in admin_urls:
        with urllib.request.urlopen(f"{admin}/metrics", timeout=5) as response:
            for line in response.read().decode().splitlines():
                if (line.startswith("meridian_edge_stream_resumptions_total{")
                        and 'outcome="resumed"' in line):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 4)


# -- one drill --------------------------------------------------------------------------------

async def drill(lab: Lab, region: str, concurrency: int, warm_s: float, after_s: float,
                timeout_s: float, model: str = MODELS["enginesim"],
                cut: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Kill `region` through the drill API, or, given `cut`, cut it off with that."""
    client_url, _ = lab.edges[region]
    admins = [admin for _, admin in lab.edges.values()]
    resumed_before = await asyncio.to_thread(resumptions, admins)
    load = Load(client_url, lab.demo_key, concurrency, model)
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(stop))
    await asyncio.sleep(warm_s)
    log(f"  {len(load.outcomes)} requests in {warm_s:.0f} s of warm-up; "
        f"{'killing' if cut is None else 'partitioning'} {region}")
    if cut is None:
        incident = await asyncio.to_thread(api, "POST", f"{lab.base}/api/v1/incidents/drill/",
                                           lab.token, {"region": region})
        started = iso_time(incident["started_at"])
    else:
        started = time.time()
        await asyncio.to_thread(cut, region)
    tables_at: float | None = None
    try:
        # A cut the control plane sees shows in the tables within seconds; one it cannot see
        # (a relay black hole) is given as long as the edges' stall limit and then some.
        pushed = await _tables_without(lab, region, started,
                                       timeout_s if cut is None else min(timeout_s, 20.0))
        log(f"  every edge's table is without {region} at +{pushed - started:.2f} s")
        tables_at = pushed
    except RuntimeError as exc:
        if cut is None:
            raise
        # A relay black hole: the control plane never sees it, and nothing is replaced.
        log(f"  {exc}")
    ready_at = down_at = None
    deadline = time.monotonic() + (timeout_s if tables_at is not None else 0.0)
    # The region goes down before its replacements are ready, if it goes down at all.
    while time.monotonic() < deadline and ready_at is None:
        try:  # a busy control plane may not answer within a call's 10 s: ask again
            if down_at is None:
                down_at = await asyncio.to_thread(_region_down_at, lab, region)
            if cut is not None:
                incident = await asyncio.to_thread(_incident_since, lab, region, started)
                if incident is None:
                    await asyncio.sleep(0.25)
                    continue
            detail = await asyncio.to_thread(api, "GET", f"{lab.base}/api/v1/incidents/"
                                             f"{incident['id']}/", lab.token)
        except OSError as exc:
            log(f"  the API did not answer ({exc}); asking again")
            await asyncio.sleep(0.25)
            continue
        if detail["replacement_ready_at"] and ready_at is None:
            ready_at = iso_time(detail["replacement_ready_at"])
        await asyncio.sleep(0.25)
    log("  region down at " + (f"+{down_at - started:.2f} s" if down_at else "— (never)"))
    log("  replacements ready at " + (f"+{ready_at - started:.2f} s" if ready_at else "— (timed out)"))
    await asyncio.sleep(after_s)
    stop.set()
    await runner
    failures = [o for o in load.outcomes if not o.ok]
    ttft: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    for o in load.outcomes:
        if o.ok and o.first_byte is not None:
            phase = ("before" if o.started < started else
                     "during" if ready_at is None or o.started < ready_at else "after")
            ttft[phase].append(o.first_byte - o.started)
    last_error = max((o.ended for o in failures), default=None)
    resumed = await asyncio.to_thread(resumptions, admins) - resumed_before
    # The streams in flight when the region died: those a resumption had to carry.
    in_flight = [o for o in load.outcomes
                 if o.stream and o.ok and o.started < started < o.ended]
    text_ok = await answers_match(load, in_flight)
    result = {
        "region": region, "requests": len(load.outcomes),
        "failed_before_first_byte": sum(o.failed_before_first_byte for o in failures),
        "streams_cut": sum(o.cut for o in failures),
        "streams_resumed": int(resumed),
        "streams_in_flight_at_kill": len(in_flight),
        "resumed_text_ok": text_ok,
        "s_to_last_error": None if last_error is None else round(max(last_error - started, 0.0), 3),
        "s_to_tables_pushed": None if tables_at is None else round(tables_at - started, 3),
        "s_to_region_down": None if down_at is None else round(down_at - started, 3),
        "s_to_replacement_ready": None if ready_at is None else round(ready_at - started, 3),
        "ttft_p95_s": {phase: p95(values) for phase, values in ttft.items()},
        "errors": sorted({o.detail for o in failures})[:5],
    }
    log(f"  {result['requests']} requests: {result['failed_before_first_byte']} failed before "
        f"the first byte, {result['streams_cut']} streams cut, {result['streams_resumed']} "
        f"resumed (text as the engine's: {result['resumed_text_ok']}); last error at "
        f"{result['s_to_last_error']} s")
    return result


def _region_down_at(lab: Lab, region: str) -> float | None:
    """When the control plane marked `region` down, if it has (its health row's change)."""
    rows = api("GET", f"{lab.base}/api/v1/region-health/?state=down&page_size=100",
               lab.token)["results"]
    for row in rows:
        if row["region"] == region:
            return iso_time(row["changed_at"])
    return None


def _incident_since(lab: Lab, region: str, since: float) -> dict[str, Any] | None:
    """The incident the control plane opened for `region` after `since` (a partition is
    found by the failover loop, not started through the drill API)."""
    rows = api("GET", f"{lab.base}/api/v1/incidents/?ordering=-started_at&page_size=20",
               lab.token)["results"]
    for row in rows:
        if row["region"] == region and iso_time(row["started_at"]) >= since - 1.0:
            return dict(row)
    return None


# -- partitions -------------------------------------------------------------------------------

class Partitions:
    """How `--fault partition` cuts a region off: with network namespaces, every lab region's
    engines run in one of its own (`MERIDIAN_LAB_NETNS`, read by the lab's workers) and its
    link goes down; without them (or asked to), the region's relays are black-holed
    (SIGUSR1). The control plane probes engines directly, not through the relays, so a black
    hole cuts off only the edges: the control plane never sees it, and the edges find the
    replicas hung (their relays' kernel acknowledges) by their probes and first-byte and
    per-token limits."""

    def __init__(self, regions: Sequence[str], var_dir: Path, by: str = "netns") -> None:
        self.var_dir = var_dir
        why_not = netns.why_unavailable() if by == "netns" else "asked for (--partition-by)"
        self.by = (f"relay black hole (SIGUSR1; {why_not}): the edges' side only"
                   if why_not else "network namespace, link down (packets dropped, no reset)")
        self._lab: netns.Lab | None = None
        self.regions: dict[str, netns.Region] = {}
        if why_not is None:
            self._lab = netns.Lab()
            self._lab.start()
            for key in regions:
                self.regions[key] = self._lab.region()

    @property
    def environment(self) -> dict[str, str]:
        return {"MERIDIAN_LAB_NETNS": ",".join(
            f"{key}={r.name}@{r.address}" for key, r in self.regions.items())}

    def cut(self, region: str) -> None:
        if region in self.regions:
            self.regions[region].partition()
            return
        for path in (self.var_dir / "lab" / "replicas").glob("*.json"):
            record = json.loads(path.read_text())
            if record.get("region") == region and record.get("relay_pid"):
                os.kill(int(record["relay_pid"]), signal.SIGUSR1)

    def close(self) -> None:
        """Remove the namespaces and whatever still runs inside them."""
        if self._lab is not None:
            self._lab.close()
            self._lab = None


async def _tables_without(lab: Lab, region: str, since: float, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            tables = await asyncio.gather(*(asyncio.to_thread(edge_replicas, lab, admin)
                                            for _, admin in lab.edges.values()))
        except OSError:  # an edge busy past the call's 2 s: ask again
            continue
        if all(all(r["region"] != region for r in rows) for rows in tables):
            return time.time()
        await asyncio.sleep(0.05)
    raise RuntimeError(f"edges still route to {region} after {timeout_s:.0f} s")


def set_ejection(lab: Lab, after_failures: int) -> None:
    policy = api("GET", f"{lab.base}/api/v1/routing-policy/", lab.token)["results"][0]
    api("PATCH", f"{lab.base}/api/v1/routing-policy/{policy['id']}/", lab.token,
        {"eject_after_failures": after_failures})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--engine", choices=("enginesim", "vllm"), default="enginesim",
                        help="what the lab's replicas run: enginesim (default) or real vLLM "
                             "CPU engines (`make engine`)")
    parser.add_argument("--fault", choices=("kill", "partition"), default="kill",
                        help="how the region dies: its processes SIGKILLed (default), or its "
                             "network cut off with the processes left running")
    parser.add_argument("--partition-by", choices=("netns", "relay"), default="netns",
                        help="how --fault partition cuts: the region's network namespace "
                             "link (default, where namespaces can be made) or a black hole "
                             "in its relays (the edges' side only)")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run that goes through every step: one replica per "
                             "region, the first drill only, seconds of load")
    add_lab_option(parser)
    args = parser.parse_args()
    if args.lab is not None and args.fault == "partition":
        parser.error("--fault partition starts its own lab (its regions' namespaces are set "
                     "when the lab starts): leave out --lab")
    concurrency = args.concurrency or (4 if args.smoke else 8 if args.quick else 24)
    warm_s, after_s = ((1.0, 1.0) if args.smoke else (4.0, 3.0) if args.quick
                       else (15.0, 15.0))
    real = args.engine == "vllm"
    per_region = 1 if args.smoke else REPLICAS_PER_REGION[args.engine]
    regions = 2 if real else 3
    # A real engine takes 20-70 s to start (longer on a busy machine): so does a replacement.
    # A smoke run does not wait for a real one.
    timeout_s = 30.0 if args.smoke else 300.0 if real else 90.0
    model = MODELS[args.engine]
    bare = None
    verb = "kill" if args.fault == "kill" else "partition"
    with tempfile.TemporaryDirectory(prefix="meridian-failover-") as tmp:
        partitions = None
        if args.fault == "partition":
            partitions = Partitions(LAB_REGION_KEYS[:regions], Path(tmp), args.partition_by)
            log(f"partitions by {partitions.by}")
            os.environ.update(partitions.environment)  # the lab and its workers inherit it
        log(f"starting the lab ({regions} local regions × {per_region} {args.engine} "
            "replicas, 2 edges)" if args.lab is None else f"driving the lab of {args.lab}")
        started = time.monotonic()
        try:
            with running_lab(args.lab, Path(tmp), engine=args.engine,
                             replicas_per_region=per_region,
                             name_prefix="meridian_bench_failover") as lab:
                wait_ready(lab, regions * per_region, timeout_s=300 if real else 180)
                log(f"lab ready in {time.monotonic() - started:.0f} s")
                cut = partitions.cut if partitions is not None else None
                log(f"run 1 (normal): {verb} local:eu-frankfurt under load through edge-eu")
                normal = asyncio.run(drill(lab, "local:eu-frankfurt", concurrency, warm_s,
                                           after_s, timeout_s, model, cut))
                if not real and not args.smoke:
                    log(f"run 2 (no_ejection): passive ejection off; {verb} local:us-virginia "
                        "via edge-us")
                    set_ejection(lab, 100)
                    time.sleep(2)  # the policy reaches the edges with the next table
                    bare = asyncio.run(drill(lab, "local:us-virginia", concurrency, warm_s,
                                             after_s, timeout_s, model, cut))
        finally:
            if partitions is not None:
                partitions.close()
    print(json.dumps({"benchmark": "failover", "engine": args.engine, "quick": args.quick,
                      "smoke": args.smoke,
                      "fault": args.fault,
                      "partitioned_by": partitions.by if partitions is not None else None,
                      "concurrency": concurrency,
                      **{k: v for k, v in normal.items() if k != "errors"},
                      "runs": {"normal": normal, "no_ejection": bare},
                      "targets": {"failed_before_first_byte": 0, "streams_cut": 0,
                                  "s_to_last_error": 2.0, "s_to_tables_pushed": 1.0}}))


if __name__ == "__main__":
    main()
