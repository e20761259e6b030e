"""An OpenAI batch through an edge, beside interactive chat, with a worker and a replica killed.

Starts the lab (`python -m controlplane.lab`: control plane, workers, beat, three local
regions of enginesim replicas, two edges) against a database and Redis database of its own,
with short batch leases (MERIDIAN_BATCH_LEASE_S=12, MERIDIAN_BATCH_REQUEST_TIMEOUT_S=10) so
that lines a killed worker held are claimed again within the run, and the demo tenant's
RPM/TPM limits raised (what is measured is scheduling, not rate limits). Then, through the
lab's first edge:

1. interactive only: chat requests (half streamed) from a few concurrent clients, for a
   while; their TTFT (first byte at the client) is the baseline;
2. the same chat load, and a batch of N lines (2,000; 200 with --quick) uploaded, created,
   polled and read with the official `openai` package, unchanged, pointed at the edge. Once
   a fifth of the lines is done, the Celery pool process holding lines of the batch is
   SIGKILLed (its lines are claimed again when their lease ends); once two fifths are, one
   replica (engine and relay) is SIGKILLed.

Then: `lost` (lines in neither the output nor the error file: must be 0); `duplicated`
(lines sent after their result was stored, from an audit of every send in the edges' access
logs — each send's request id names its batch, line and attempt — against each line's
finished_at in the database: must be 0); `interactive_ttft_p95_ratio` (interactive TTFT p95
while the batch ran over before it); the batch's $/Mtok (its token share of its replicas' $
while it ran, `meridian.cost` in the batch's answer) beside the interactive $/Mtok (the same
replicas' $ over the tokens they served in phase 1, `batches.cost.window_cost`) and their
ratio; `batch_tokens_per_s`; the client's name and version.

With --batch-tier the batch runs on a batch-tier deployment of the model (`demo-batch`,
min_replicas 0, created at zero before the batch): the edges send batch work to it alone,
its first line's "no replica" answer wakes it (the autoscaler's scale from zero), and after
the batch it goes back to zero once idle for MERIDIAN_SCALE_DOWN_WINDOW_S (15 s here, 60 s by
default). It adds `s_to_first_batch_replica` (batch created to the deployment's first ready
replica: the cold start) and `batch_replicas_after` (its live replicas once the idle window
has passed: 0, or the count with a note that the window outlasted the wait). The replica
killed mid-run is then an interactive one.

    python bench/batch.py [--quick] [--lines N] [--batch-tier]

Every process dies with the benchmark, even when it is SIGKILLed (the lab runs under a
parent-death signal and stops its children; the lab's guard stops the engines). Progress on
stderr; one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import openai  # noqa: E402
from failover import Load, p95  # noqa: E402

from controlplane.lab.child_lab import (  # noqa: E402
    Lab,
    add_lab_option,
    api,
    running_lab,
    wait_ready,
)

MODEL = "llama-3.1-8b"
EDGE_REGION = "local:eu-frankfurt"  # the lab's first edge: where batch workers send lines
LEASE_S, REQUEST_TIMEOUT_S = 12, 10
# What every run's JSON line holds (tests/bench/test_benchmarks.py checks it at --smoke).
RESULT_KEYS = ("benchmark", "quick", "smoke", "status", "lines", "completed", "failed", "lost",
               "duplicated", "interactive_ttft_p95_ratio", "interactive_ttft_p95_s",
               "usd_per_mtok_batch", "usd_per_mtok_interactive",
               "usd_per_mtok_ratio_vs_interactive", "batch_tokens_per_s", "client", "sends",
               "targets", "targets_apply")
# Its smoke run can drive a lab another process started (--lab): one started with this
# environment (the short leases above).
SMOKE_LAB = {"env": {"MERIDIAN_BATCH_LEASE_S": "12", "MERIDIAN_BATCH_REQUEST_TIMEOUT_S": "10"}}
# The demo tenant's limits, raised so that what is measured is scheduling, not rate limits
# (the batch tier has a budget of its own, the tenant's limits again).
TENANT_LIMITS = {"rpm_limit": 100_000, "tpm_limit": 50_000_000}
WORKER_KILL_AT, REPLICA_KILL_AT = 0.2, 0.4  # fractions of the lines done
# --batch-tier: the batch-tier deployment, and the lab's idle window before a scale-down.
POOL = "demo-batch"
POOL_IDLE_S = 15
LIVE = ("pending", "provisioning", "starting", "ready", "degraded")


def log(message: str) -> None:
    print(f"[batch] {message}", file=sys.stderr, flush=True)


def raise_limits(lab: Lab) -> None:
    tenants = api("GET", f"{lab.base}/api/v1/tenants/?name=demo", lab.token)["results"]
    demo = next(t for t in tenants if t["name"] == "demo")
    api("PATCH", f"{lab.base}/api/v1/tenants/{demo['id']}/", lab.token, TENANT_LIMITS)


def batch_input(lines: int) -> bytes:
    rows = []
    for i in range(lines):
        rows.append({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": MODEL, "max_tokens": 32, "temperature": 0,
                              "messages": [{"role": "user",
                                            "content": f"Summarise document {i} in a line."}]}})
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


# -- the lab's processes and rows -------------------------------------------------------------

def database(lab: Lab) -> Any:
    import psycopg

    return psycopg.connect(lab.database_url, autocommit=True)


def kill_batch_worker(lab: Lab, batch_id: str) -> dict[str, Any] | None:
    """SIGKILL the Celery pool process that holds lines of the batch now (a line's `worker`
    is host:pid of the process that claimed it)."""
    with database(lab) as conn:
        row = conn.execute(
            "SELECT worker, count(*) FROM batches_batchline WHERE batch_id = %s AND "
            "state = 'running' AND worker <> '' GROUP BY worker ORDER BY 2 DESC LIMIT 1",
            [batch_id]).fetchone()
    if row is None:
        return None
    pid = int(row[0].rsplit(":", 1)[1])
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return {"pid": pid, "lines_held": int(row[1]), "at": time.time()}


def kill_one_replica(var_dir: Path, spare: Collection[str] = ()) -> dict[str, Any] | None:
    """SIGKILL one running enginesim replica (engine and relay), from the lab's local
    provider records; never one of `spare` (public ids)."""
    for record_path in sorted(var_dir.rglob("*.json")):
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or "relay_pid" not in record or not record.get("pid"):
            continue
        if record.get("replica_id") in spare:
            continue
        killed = []
        for key in ("pid", "relay_pid"):
            pid = record.get(key)
            if pid:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    killed.append(int(pid))
                except ProcessLookupError:
                    pass
        if killed:
            return {"replica": record.get("replica_id"), "pids": killed, "at": time.time()}
    return None


def sends_audit(var_dir: Path, lab: Lab, batch_id: str) -> dict[str, Any]:
    """Every send of the batch's lines that reached an edge (the access logs' request ids
    req_<batch>_<line>_<attempt>), against when each line's result was stored."""
    prefix = "req_" + batch_id.removeprefix("batch_") + "_"
    sends: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for path in var_dir.rglob("edge-*.log"):
        for raw in path.read_text(errors="replace").splitlines():
            if prefix not in raw or not raw.startswith("{"):
                continue
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            request_id = str(entry.get("request_id", ""))
            if not request_id.startswith(prefix):
                continue
            number = int(request_id[len(prefix):].split("_")[0])
            sends[number].append((float(entry["ts"]) - float(entry.get("duration_s") or 0),
                                  int(entry.get("status") or 0)))
    with database(lab) as conn:
        finished = {int(n): at.timestamp() for n, at in conn.execute(
            "SELECT line_number, finished_at FROM batches_batchline WHERE batch_id = %s AND "
            "finished_at IS NOT NULL", [batch_id]).fetchall()}
    duplicated = sorted(n for n, rows in sends.items()
                        if n in finished and any(start > finished[n] for start, _ in rows))
    answered_twice = sum(1 for rows in sends.values() if sum(s == 200 for _, s in rows) > 1)
    return {"lines_sent": len(sends), "sends": sum(len(r) for r in sends.values()),
            "duplicated": len(duplicated), "duplicated_lines": duplicated[:10],
            "answered_twice": answered_twice}


def interactive_cost(lab: Lab, start: float, end: float) -> dict[str, Any]:
    """The replicas' $ and tokens over the interactive-only phase (batches.cost.window_cost,
    read from the lab's database)."""
    os.environ["DATABASE_URL"] = lab.database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("MERIDIAN_LAB", "1")  # a bench runs on the lab
    import django

    django.setup()
    from datetime import UTC, datetime

    from django.db import connections

    from controlplane.batches.cost import window_cost

    try:
        window = window_cost(MODEL, datetime.fromtimestamp(start, UTC),
                             datetime.fromtimestamp(end, UTC))
        return {"usd": float(window.usd), "tokens": window.tokens,
                "usd_per_mtok": window.usd_per_mtok}
    finally:
        connections.close_all()


# -- the batch-tier deployment (--batch-tier) --------------------------------------------------

def create_pool(lab: Lab) -> None:
    """A batch-tier deployment of the model, like the demo one but at zero (min_replicas 0)."""
    demo = api("GET", f"{lab.base}/api/v1/deployments/demo-chat/", lab.token)
    api("POST", f"{lab.base}/api/v1/deployments/", lab.token, {
        "name": POOL, "served_model_name": MODEL, "model": demo["model"], "tier": "batch",
        "allowed_jurisdictions": demo["allowed_jurisdictions"],
        "user_regions": demo["user_regions"], "engine": demo["engine"],
        "max_model_len": demo["max_model_len"], "min_replicas": 0, "max_replicas": 1,
        "spread_regions": 1, "autoscale": True, "scale_down_cooldown_s": 0})


def pool_replicas(lab: Lab) -> list[dict[str, Any]]:
    return list(api("GET", f"{lab.base}/api/v1/replicas/?deployment={POOL}&page_size=100",
                    lab.token)["results"])


class PoolWatch:
    """Polls the batch-tier deployment's replicas every half second in a thread: when the
    first was ready, and how many are live now."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.first_ready_at: float | None = None
        self.live = 0
        self.ids: set[str] = set()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                rows = pool_replicas(self.lab)
            except OSError:
                rows = None
            if rows is not None:
                self.ids |= {r["public_id"] for r in rows}
                self.live = sum(1 for r in rows if r["state"] in LIVE)
                if self.first_ready_at is None and any(r["state"] == "ready" for r in rows):
                    self.first_ready_at = time.time()
            self.stopped.wait(0.5)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(10)


def wait_for_zero(watch: PoolWatch, timeout_s: float) -> float | None:
    """Seconds until the batch-tier deployment has no live replica, or None at the deadline."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if watch.live == 0:
            return round(time.monotonic() - started, 1)
        time.sleep(0.5)
    return None


# -- the run ----------------------------------------------------------------------------------

class Chat:
    """Interactive chat through an edge in a thread of its own, until stopped."""

    def __init__(self, url: str, key: str, concurrency: int) -> None:
        self.load = Load(url, key, concurrency, MODEL)
        self.loop = asyncio.new_event_loop()
        self.stop_event: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self.stop_event = asyncio.Event()
            await self.load.run(self.stop_event)

        self.loop.run_until_complete(main())

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        while self.stop_event is None:
            time.sleep(0.01)
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(60)

    def ttft_between(self, start: float, end: float) -> list[float]:
        return [o.first_byte - o.started for o in list(self.load.outcomes)
                if o.ok and o.first_byte is not None and start <= o.started < end]

    def failures_between(self, start: float, end: float) -> int:
        return sum(1 for o in list(self.load.outcomes) if not o.ok and start <= o.started < end)

    def errors(self) -> list[str]:
        return sorted({o.detail for o in list(self.load.outcomes) if not o.ok})[:5]


def run_batch(lab: Lab, var_dir: Path, edge_url: str, lines: int,
              timeout_s: float, watch: PoolWatch | None = None,
              kill_worker: bool = True) -> dict[str, Any]:
    client = openai.OpenAI(api_key=lab.demo_key, base_url=f"{edge_url}/v1", max_retries=2,
                           timeout=60)
    try:
        uploaded = client.files.create(file=("bench.jsonl", io.BytesIO(batch_input(lines))),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id,
                                      endpoint="/v1/chat/completions", completion_window="24h",
                                      metadata={"bench": "batch"})
        created_at = time.time()
        log(f"  batch {batch.id}: {lines} lines uploaded ({uploaded.bytes} bytes) and created")
        worker_kill = replica_kill = None
        deadline = time.monotonic() + timeout_s
        last_log = 0.0
        while True:
            batch = client.batches.retrieve(batch.id)
            counts = batch.request_counts
            done = (counts.completed + counts.failed) if counts else 0
            if time.monotonic() - last_log > 5:
                pool = "" if watch is None else f" ({POOL}: {watch.live} live replica(s))"
                log(f"  {batch.status}: {done}/{lines} lines done{pool}")
                last_log = time.monotonic()
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                break
            if kill_worker and worker_kill is None and done >= WORKER_KILL_AT * lines:
                worker_kill = kill_batch_worker(lab, batch.id)
                if worker_kill:
                    log(f"  SIGKILLed batch worker pid {worker_kill['pid']} holding "
                        f"{worker_kill['lines_held']} lines")
            if replica_kill is None and done >= REPLICA_KILL_AT * lines:
                replica_kill = kill_one_replica(var_dir, watch.ids if watch else set())
                if replica_kill:
                    log(f"  SIGKILLed replica {replica_kill['replica']}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batch.id} not finished after {timeout_s:.0f} s "
                                   f"({done}/{lines} lines)")
            time.sleep(0.5)
        raw = client.batches.with_raw_response.retrieve(batch.id).http_response.json()
        output = client.files.content(batch.output_file_id).text if batch.output_file_id \
            else ""
        errors = client.files.content(batch.error_file_id).text if batch.error_file_id else ""
    finally:
        client.close()
    answered = {json.loads(r)["custom_id"] for r in (output + errors).splitlines() if r}
    ok = [json.loads(r) for r in output.splitlines() if r]
    failed = [json.loads(r) for r in errors.splitlines() if r]
    return {"batch": batch, "answer": raw, "answered": answered, "completed": len(ok),
            "created_at": created_at,
            "failed": len(failed), "worker_kill": worker_kill, "replica_kill": replica_kill,
            "line_errors": sorted({json.dumps(f.get("error")) for f in failed})[:5]}


def targets_apply(quick: bool, smoke: bool, lines: int | None) -> dict[str, Any]:
    """The targets a run of this size is judged by: all of them for the full run; lost and
    duplicated lines for any run; the TTFT and cost ratios not for --quick or --smoke."""
    if not (quick or smoke) or lines is not None and lines >= 2000:
        return {"all": True}
    return {"all": False, "lost": True, "duplicated": True,
            "interactive_ttft_p95_ratio": False, "usd_per_mtok_ratio_vs_interactive": False,
            "why": "a quick run has one replica per region, so the replica killed mid-run is "
                   "a third of the interactive capacity (a sixth in the full run), and its "
                   "batch lasts 15-20 s against 8 s of interactive load alone before it: the "
                   "TTFT p95s rest on a few hundred requests and move by more than the "
                   "target's margin from run to run (1.22-1.28x in five runs); the full "
                   "2,000-line run is the one the ratio targets are set for"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run that goes through the steps: 20 lines, 2 s "
                             "of interactive load before them, a replica killed but no worker "
                             "(its lines would wait out their lease)")
    add_lab_option(parser, "SMOKE_LAB's environment")
    parser.add_argument("--lines", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=4, help="interactive clients")
    parser.add_argument("--batch-tier", action="store_true",
                        help=f"run the batch on a batch-tier deployment ({POOL}) that starts "
                             "at zero and goes back to zero after it")
    args = parser.parse_args()
    if args.lab is not None and args.batch_tier:
        parser.error("--batch-tier starts its own lab (with a short scale-down window): "
                     "leave out --lab")
    lines = args.lines or (20 if args.smoke else 200 if args.quick else 2000)
    baseline_s = 2.0 if args.smoke else 8.0 if args.quick else 30.0
    per_region = 1 if args.quick or args.smoke else 2
    lab_env = {"MERIDIAN_BATCH_LEASE_S": str(LEASE_S),
               "MERIDIAN_BATCH_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S)}
    if args.batch_tier:
        lab_env["MERIDIAN_SCALE_DOWN_WINDOW_S"] = str(POOL_IDLE_S)
    pool: dict[str, Any] = {}
    log(f"starting the lab (3 local regions × {per_region} enginesim replicas, 2 edges)"
        if args.lab is None else f"driving the lab of {args.lab}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meridian-batch-") as tmp, running_lab(
            args.lab, Path(tmp), replicas_per_region=per_region, env=lab_env,
            name_prefix="meridian_bench_batch") as lab:
        var_dir = lab.var_dir
        chat: Chat | None = None
        watch: PoolWatch | None = None
        try:
            wait_ready(lab, 3 * per_region)
            log(f"lab ready in {time.monotonic() - t0:.0f} s")
            raise_limits(lab)
            if args.batch_tier:
                create_pool(lab)
                watch = PoolWatch(lab)
                watch.start()
                log(f"{POOL}: a batch-tier deployment of {MODEL} at zero")
            time.sleep(3)  # the new limits reach the edges with the next table
            edge_url = lab.edges[EDGE_REGION][0]
            chat = Chat(edge_url, lab.demo_key, args.concurrency)
            chat.start()
            base_start = time.time()
            time.sleep(baseline_s)
            base_end = time.time()
            log(f"interactive only: {len(chat.ttft_between(base_start, base_end))} requests in "
                f"{baseline_s:.0f} s; now the batch")
            result = run_batch(lab, var_dir, edge_url, lines,
                               120.0 if args.quick or args.smoke else 900.0, watch,
                               # Its lines would wait out their 12 s lease: not in a smoke run.
                               kill_worker=not args.smoke)
            batch_end = time.time()
            chat.stop()
            if watch is not None:
                # Idle from here: the window, a 2 s decision loop, and the drain's end.
                limit_s = POOL_IDLE_S + 30.0
                log(f"waiting up to {limit_s:.0f} s for {POOL} to go back to zero")
                to_zero = wait_for_zero(watch, limit_s)
                first = watch.first_ready_at
                pool = {
                    "s_to_first_batch_replica": None if first is None
                    else round(first - result["created_at"], 1),
                    "batch_replicas_after": watch.live,
                    "s_batch_end_to_zero": to_zero,
                    "scale_down_window_s": POOL_IDLE_S,
                }
                if to_zero is None:
                    pool["note"] = (f"{POOL} still had {watch.live} live replica(s) "
                                    f"{limit_s:.0f} s after the batch: the window and drain "
                                    "outlasted the wait")
            time.sleep(1.0)  # the edges' access logs are written every 200 ms
            audit = sends_audit(var_dir, lab, result["batch"].id)
            interactive = interactive_cost(lab, base_start, base_end)
        finally:
            if watch is not None:
                watch.stop()
            if chat is not None and chat.thread.is_alive():
                chat.stop()

    batch = result["batch"]
    cost = result["answer"].get("meridian", {}).get("cost", {})
    ran_s = (batch.completed_at or int(batch_end)) - (batch.in_progress_at or batch.created_at)
    batch_start = float(batch.in_progress_at or batch.created_at)
    without = p95(chat.ttft_between(base_start, base_end))
    with_batch = p95(chat.ttft_between(batch_start, batch_end))

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    print(json.dumps({
        "benchmark": "batch", "quick": args.quick, "smoke": args.smoke, "status": batch.status,
        "lines": lines, "completed": result["completed"], "failed": result["failed"],
        "lost": lines - len(result["answered"]),
        "duplicated": audit["duplicated"],
        "interactive_ttft_p95_ratio": ratio(with_batch, without),
        "interactive_ttft_p95_s": {"without_batch": without, "with_batch": with_batch},
        "interactive_failed": {"without_batch": chat.failures_between(base_start, base_end),
                               "with_batch": chat.failures_between(batch_start, batch_end)},
        "interactive_errors": chat.errors(), "line_errors": result["line_errors"],
        "tenant_limits": TENANT_LIMITS,
        "usd_per_mtok_batch": cost.get("usd_per_mtok"),
        "usd_per_mtok_interactive": interactive["usd_per_mtok"],
        "usd_per_mtok_ratio_vs_interactive": ratio(cost.get("usd_per_mtok"),
                                                   interactive["usd_per_mtok"]),
        "batch_tokens_per_s": round(cost.get("tokens", 0) / ran_s, 1) if ran_s > 0 else None,
        "batch_usd": cost.get("usd"), "batch_tokens": cost.get("tokens"), "batch_s": ran_s,
        "client": f"openai {openai.__version__}",
        "batch_tier": args.batch_tier, **pool,
        "sends": audit, "worker_kill": result["worker_kill"],
        "replica_kill": result["replica_kill"], "interactive_window": interactive,
        "cost": cost,
        "targets": {"lost": 0, "duplicated": 0, "interactive_ttft_p95_ratio": 1.25,
                    "usd_per_mtok_ratio_vs_interactive": 0.6},
        # Which targets this size of run can be judged by, and why not the others.
        "targets_apply": targets_apply(args.quick, args.smoke, args.lines),
    }))


if __name__ == "__main__":
    main()
