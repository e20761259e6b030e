"""The REST API and the dashboard under 32 clients: throughput and latency per endpoint, and
whether /api/v1/status/ stays fast and true meanwhile.

Starts the whole lab (`python -m controlplane.lab`: gunicorn, Celery workers and beat, three
local regions with one enginesim replica each, two edges) in a var dir, database, Redis
database and ports of its own, waits until status says every worker and beat is fresh, then
runs 32 closed-loop clients for 30 s. Each client sends one request after another (a new
connection each, as a monitor does), going round the targets from its own starting point:
list endpoints (replicas, deployments, offers, regions, audit log), the status endpoint and a
dashboard page (the deployments page, logged in as the lab's admin). Every answer is timed;
an HTTP error or a refused or reset connection counts as an error, no answer within
TIMEOUT_S as a timeout. A status answer is true when it is 200 and says ok, celery ok and
beat ok.

    python bench/api_load.py [--quick | --smoke] [--lab FILE] [--clients N] [--seconds S]
                             [--compare unniced|plain|none] [--no-status-lane]

`--quick`: 10 s of load; `--smoke`: 3 s (every step, not the figures); `--lab FILE` drives a
running lab instead of starting one; `--no-status-lane` starts the lab with plain gthread web
workers (controlplane/lab/status_lane.py). Per target: requests, req/s, p50, p99, errors and
timeouts; and the targets: status p99 under 50 ms, no timeouts, status never false.

Side by side in the same run (`--compare`, default `unniced`): beside the lab's web tier the
benchmark starts a second one on a port of its own, the same gunicorn command with the same
environment (read in /proc from a process the lab started) and one thing changed: `unniced` runs
its ordinary request threads at the worker's priority (MERIDIAN_WEB_REQUEST_NICE=0, the
status lane as it was before they were niced), `plain` runs plain gthread workers. The
clients load one tier at a time, in slices of SLICE_S taken in turn (A B B A ...), so that
both meet the same machine; each tier gets the seconds asked. The JSON line gives the other
tier's figures and the ratios lab / other, and the load average before and after.

Every process dies with the benchmark, even when it is SIGKILLed (the lab runs under a
parent-death signal and stops its children; the clients are threads). Progress on stderr;
one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controlplane.lab.child_lab import Lab, add_lab_option, api, running_lab  # noqa: E402
from controlplane.lab.cli import WEB_THREADS, WEB_WORKERS  # noqa: E402
from controlplane.lab.engines import free_port  # noqa: E402
from controlplane.lab.processes import die_with_parent  # noqa: E402
from controlplane.lab.status_lane import REQUEST_NICE_ENV  # noqa: E402
from controlplane.lab.waiting import wait_until  # noqa: E402

CLIENTS = 32
TIMEOUT_S = 5.0
STATUS = "/api/v1/status/"
DASHBOARD = "/deployments/"
# What the clients go round: list endpoints, status and a dashboard page.
TARGETS = ("/api/v1/replicas/?page_size=50", "/api/v1/deployments/",
           "/api/v1/offers/?page_size=50", STATUS, "/api/v1/regions/",
           "/api/v1/audit-log/?page_size=50", DASHBOARD)
GOALS = {"status_p99_ms": 50.0, "timeouts": 0, "status_false": 0}
# The second web tier `--compare` starts: what it changes in the lab's gunicorn command.
VARIANTS = ("unniced", "plain", "none")
SLICE_S = 5.0
# What every run's JSON line holds (tests/bench/test_benchmarks.py checks it at --smoke).
RESULT_KEYS = ("benchmark", "quick", "smoke", "clients", "seconds", "requests", "rps",
               "errors", "timeouts", "targets", "status_p50_ms", "status_p99_ms",
               "others_rps", "status_always_true", "status_false", "status_false_samples",
               "goals", "met", "compare", "load_average")
# Its smoke run drives the lab the benchmark tests share (--lab): a lab as `make up` starts.
SMOKE_LAB: dict[str, object] = {}


def log(message: str) -> None:
    print(f"[api_load] {message}", file=sys.stderr, flush=True)


@dataclass
class Outcome:
    tier: str  # "lab", or the variant `--compare` started
    target: str
    started: float
    ms: float
    kind: str  # "ok", "error", "timeout"
    detail: str = ""
    status_true: bool | None = None  # for status answers


def lab_password(lab: Lab) -> str:
    return (lab.var_dir / "lab" / "admin-password").read_text().strip()


def dashboard_session(lab: Lab) -> str:
    """A logged-in dashboard session's cookie header, as the lab's admin."""
    conn = http.client.HTTPConnection(urllib.parse.urlsplit(lab.base).netloc, timeout=10)
    conn.request("GET", "/login/")
    response = conn.getresponse()
    page = response.read().decode()
    cookies = {c.split("=", 1)[0]: c.split("=", 1)[1].split(";", 1)[0]
               for c in response.headers.get_all("Set-Cookie") or []}
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    if match is None or "csrftoken" not in cookies:
        raise RuntimeError("the login page gave no CSRF token")
    body = urllib.parse.urlencode({"username": "admin", "password": lab_password(lab),
                                   "csrfmiddlewaretoken": match.group(1), "next": DASHBOARD})
    conn.request("POST", "/login/", body=body, headers={
        "Content-Type": "application/x-www-form-urlencoded",
        "Cookie": f"csrftoken={cookies['csrftoken']}", "Referer": f"{lab.base}/login/"})
    response = conn.getresponse()
    response.read()
    conn.close()
    for cookie in response.headers.get_all("Set-Cookie") or []:
        if cookie.startswith("sessionid="):
            return f"sessionid={cookie.split('=', 1)[1].split(';', 1)[0]}"
    raise RuntimeError(f"logging in answered {response.status} without a session")


def status_true(body: Any) -> bool:
    return bool(body.get("ok") and body.get("celery", {}).get("ok")
                and body.get("beat", {}).get("ok"))


@dataclass
class Load:
    """Closed-loop clients going round the targets; every outcome kept."""

    lab: Lab
    session_cookie: str
    clients: int
    outcomes: list[Outcome] = field(default_factory=list)

    def request(self, tier: str, base: str, target: str) -> Outcome:
        netloc = urllib.parse.urlsplit(base).netloc
        headers = ({"Cookie": self.session_cookie} if target == DASHBOARD
                   else {"Authorization": f"Bearer {self.lab.token}"})
        started = time.time()
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection(netloc, timeout=TIMEOUT_S)
        try:
            conn.request("GET", target, headers=headers)
            response = conn.getresponse()
            body = response.read()
            ms = (time.perf_counter() - t0) * 1000
            if target != STATUS:
                kind = "error" if response.status >= 400 else "ok"
                return Outcome(tier, target, started, ms, kind, f"HTTP {response.status}")
            try:
                truth = response.status == 200 and status_true(json.loads(body))
            except ValueError:
                truth = False
            # A 503 is status's own answer (false), not a failed request.
            kind = "error" if response.status >= 400 and response.status != 503 else "ok"
            return Outcome(tier, target, started, ms, kind,
                           "" if truth else body.decode(errors="replace")[:300], truth)
        except TimeoutError:
            return Outcome(tier, target, started, (time.perf_counter() - t0) * 1000, "timeout",
                           "no answer", False if target == STATUS else None)
        except (OSError, http.client.HTTPException) as exc:
            return Outcome(tier, target, started, (time.perf_counter() - t0) * 1000, "error",
                           f"{type(exc).__name__}: {exc}"[:160],
                           False if target == STATUS else None)
        finally:
            conn.close()

    def client(self, i: int, tier: str, base: str, stop: threading.Event,
               outcomes: list[Outcome]) -> None:
        n = i
        while not stop.is_set():
            outcomes.append(self.request(tier, base, TARGETS[n % len(TARGETS)]))
            n += 1

    def run(self, tier: str, base: str, seconds: float) -> float:
        """`seconds` of load on one tier; its outcomes (those started in time) are kept.
        Returns the seconds it ran."""
        outcomes: list[Outcome] = []
        stop = threading.Event()
        threads = [threading.Thread(target=self.client, args=(i, tier, base, stop, outcomes),
                                    daemon=True) for i in range(self.clients)]
        started = time.time()
        for thread in threads:
            thread.start()
        stop.wait(seconds)
        stop.set()
        ended = time.time()
        for thread in threads:
            thread.join(TIMEOUT_S + 5)
        done = [o for o in outcomes if o.started <= ended]
        self.outcomes.extend(done)
        status = [o for o in done if o.target == STATUS]
        log(f"  {tier}: {len(done)} requests in {ended - started:.0f} s, "
            f"{sum(o.kind != 'ok' for o in done)} failed, status p99 "
            f"{percentile([o.ms for o in status], 99):.0f} ms, "
            f"{sum(o.status_true is False for o in status)} false, "
            f"load average {os.getloadavg()[0]:.1f}")
        return ended - started


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summary(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    ms = [o.ms for o in outcomes if o.kind == "ok"]
    return {"requests": len(outcomes), "rps": round(len(outcomes) / seconds, 1),
            "p50_ms": round(percentile(ms, 50), 1), "p99_ms": round(percentile(ms, 99), 1),
            "errors": sum(o.kind == "error" for o in outcomes),
            "timeouts": sum(o.kind == "timeout" for o in outcomes)}


def tier_report(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    """One tier's figures: in all, per target, status's and the other targets' throughput."""
    targets = {target: summary([o for o in outcomes if o.target == target], seconds)
               for target in TARGETS}
    status = [o for o in outcomes if o.target == STATUS]
    false = [o for o in status if o.status_true is False]
    overall = summary(outcomes, seconds)
    return {
        "seconds": round(seconds, 1), "requests": overall["requests"], "rps": overall["rps"],
        "errors": overall["errors"], "timeouts": overall["timeouts"], "targets": targets,
        "status_p50_ms": targets[STATUS]["p50_ms"], "status_p99_ms": targets[STATUS]["p99_ms"],
        "others_rps": round(sum(1 for o in outcomes if o.target != STATUS) / seconds, 1),
        "status_always_true": not false and bool(status), "status_false": len(false),
        "status_false_samples": sorted({o.detail for o in false})[:3],
    }


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def lab_environment(lab_pid: int) -> dict[str, str]:
    """The environment the lab gives the processes it starts, read from one of them in /proc
    (the web tier's own is overwritten by its process title; of those intact, the largest:
    the lab adds to it as it starts them)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    descendants: set[int] = set()
    frontier = {lab_pid}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - descendants
        descendants |= frontier
    found: list[dict[str, str]] = []
    for pid in descendants:
        with contextlib.suppress(OSError):
            raw = (Path("/proc") / str(pid) / "environ").read_bytes()
            env = dict(item.decode(errors="replace").split("=", 1)
                       for item in raw.split(b"\0") if b"=" in item)
            if {"DATABASE_URL", "REDIS_URL", "MERIDIAN_VAR_DIR", "MERIDIAN_CA_DIR"} <= set(env):
                found.append(env)
    if not found:
        raise RuntimeError(f"no process of the lab {lab_pid} shows the lab's environment")
    return max(found, key=len)


def variant_command(variant: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The lab's gunicorn command (controlplane/lab/startup.py, its default sizing) bound to
    `port`, with `variant` changed, and what it changes in the environment."""
    argv = [sys.executable, "-m", "gunicorn", "controlplane.wsgi", "--bind",
            f"127.0.0.1:{port}", "--workers", str(WEB_WORKERS), "--threads", str(WEB_THREADS),
            "--access-logfile", "-", "--preload"]
    if variant == "plain":
        return argv, {}
    return [*argv, "--worker-class", "controlplane.lab.status_lane.StatusLaneWorker"], {
        REQUEST_NICE_ENV: "0"}


@contextlib.contextmanager
def comparison_tier(lab: Lab, variant: str, log_file: TextIO) -> Any:
    """A second web tier beside the lab's (`variant_command`), on the same database and Redis,
    stopped at the end; its base URL once it answers status true (which it does only with
    the lab's database and Redis: the token is the lab's, the heartbeats in its Redis)."""
    port = free_port()
    argv, changes = variant_command(variant, port)
    process = subprocess.Popen(argv, env={**lab_environment(lab.pid), **changes}, cwd=REPO,
                               stdout=log_file, stderr=subprocess.STDOUT,
                               start_new_session=True,
                               preexec_fn=die_with_parent(signal.SIGTERM))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: process.poll() is None and status_true(
            api("GET", f"{base}{STATUS}", lab.token)), 90.0,
            f"the {variant} web tier to answer status", every_s=0.5,
            ignore=(OSError, ValueError))
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def slices(tiers: list[str], seconds: float) -> list[str]:
    """Which tier each slice of load goes to: SLICE_S each (or less), in turn A B B A ...,
    `seconds` in all for each tier."""
    n = max(1, math.ceil(seconds / SLICE_S))
    order = []
    for i in range(n):
        order.extend(tiers if i % 2 == 0 else tiers[::-1])
    return order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 s of load")
    parser.add_argument("--smoke", action="store_true",
                        help="3 s of load: every step, not the figures")
    add_lab_option(parser)
    parser.add_argument("--no-status-lane", action="store_true",
                        help="start the lab with plain gthread web workers (status polls "
                             "queue behind other requests); not with --lab")
    parser.add_argument("--compare", choices=VARIANTS, default="unniced",
                        help="the second web tier loaded in turn with the lab's: its request "
                             "threads unniced (default), plain gthread, or none")
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--seconds", type=float, default=None,
                        help="seconds of load on each tier")
    args = parser.parse_args()
    if args.lab is not None and args.no_status_lane:
        parser.error("--no-status-lane starts its own lab: leave out --lab")
    seconds = args.seconds or (3.0 if args.smoke else 10.0 if args.quick else 30.0)
    # 32 client threads share this interpreter: a thread whose answer has arrived must not
    # wait 5 ms (the default) for the GIL, or the figures measure the client.
    sys.setswitchinterval(0.001)
    log("starting the lab (3 local regions × 1 enginesim replica, 2 edges)"
        if args.lab is None else f"driving the lab of {args.lab}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meridian-api-load-") as tmp, running_lab(
            args.lab, Path(tmp), replicas_per_region=1, name_prefix="meridian_bench_api",
            extra=["--prometheus-port", str(free_port()),
                   *(["--no-status-lane"] if args.no_status_lane else [])]) as lab:
        wait_until(lambda: status_true(api("GET", f"{lab.base}{STATUS}", lab.token)), 120.0,
                   "status to say every worker and beat is fresh", every_s=0.5,
                   ignore=(OSError,))
        log(f"lab up and status true after {time.monotonic() - t0:.0f} s")
        with contextlib.ExitStack() as stack:
            bases = {"lab": lab.base}
            if args.compare != "none":
                tier_log = stack.enter_context(open(Path(tmp) / "compare-web.log", "w"))
                bases[args.compare] = stack.enter_context(
                    comparison_tier(lab, args.compare, tier_log))
                log(f"{args.compare} web tier up at {bases[args.compare]}")
            load = Load(lab, dashboard_session(lab), args.clients)
            # Status alone first, one request at a time: its own cost, without the load.
            alone = {tier: [load.request(tier, base, STATUS)
                            for _ in range(5 if args.smoke else 40)]
                     for tier, base in bases.items()}
            for tier, outcomes in alone.items():
                log(f"status alone on {tier}: p50 "
                    f"{percentile([o.ms for o in outcomes], 50):.1f} ms")
            load_average = [round(os.getloadavg()[0], 1)]
            log(f"{args.clients} clients, {seconds:g} s on each of {', '.join(bases)}, "
                f"load average {load_average[0]}")
            order = slices(list(bases), seconds)
            slice_s = seconds / (len(order) / len(bases))
            elapsed = dict.fromkeys(bases, 0.0)
            for tier in order:
                elapsed[tier] += load.run(tier, bases[tier], slice_s)
            load_average.append(round(os.getloadavg()[0], 1))
    reports = {tier: tier_report([o for o in load.outcomes if o.tier == tier], elapsed[tier])
               for tier in bases}
    for tier, report in reports.items():
        for target, figures in report["targets"].items():
            log(f"{tier} {target}: {figures['rps']} req/s, p50 {figures['p50_ms']} ms, p99 "
                f"{figures['p99_ms']} ms, {figures['errors']} errors, "
                f"{figures['timeouts']} timeouts")
    ours = reports["lab"]
    met = {"status_p99_ms": ours["status_p99_ms"] < GOALS["status_p99_ms"],
           "timeouts": ours["timeouts"] == 0, "status_false": not ours["status_false"]}

    def alone_figures(tier: str) -> dict[str, float]:
        ms = [o.ms for o in alone[tier]]
        return {"status_alone_p50_ms": round(percentile(ms, 50), 1),
                "status_alone_p99_ms": round(percentile(ms, 99), 1)}

    compare = None
    if args.compare != "none":
        other = reports[args.compare]
        compare = {"variant": args.compare, **other, **alone_figures(args.compare),
                   "ratios": {key: ratio(ours[key], other[key])
                              for key in ("status_p50_ms", "status_p99_ms", "others_rps")}}
        log(f"lab / {args.compare}: status p50 × {compare['ratios']['status_p50_ms']}, p99 × "
            f"{compare['ratios']['status_p99_ms']}, other req/s × "
            f"{compare['ratios']['others_rps']}")
    print(json.dumps({
        "benchmark": "api_load", "quick": args.quick, "smoke": args.smoke,
        "clients": args.clients, "status_lane": not args.no_status_lane, **ours,
        **alone_figures("lab"), "goals": GOALS, "met": met, "compare": compare,
        "load_average": load_average,
    }))


if __name__ == "__main__":
    main()
