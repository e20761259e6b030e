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
                             [--no-status-lane]

`--quick`: 10 s of load; `--smoke`: 3 s (every step, not the figures); `--lab FILE` drives a
running lab instead of starting one; `--no-status-lane` starts the lab with plain gthread web
workers (controlplane/lab/status_lane.py), for comparison. Per target: requests, req/s, p50,
p99, errors and timeouts; and the targets: status p99 under 50 ms, no timeouts, status never false.

Every process dies with the benchmark, even when it is SIGKILLed (the lab runs under a
parent-death signal and stops its children; the clients are threads). Progress on stderr;
one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controlplane.lab.child_lab import Lab, add_lab_option, api, running_lab  # noqa: E402
from controlplane.lab.engines import free_port  # noqa: E402
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
# What every run's JSON line holds (tests/bench/test_benchmarks.py checks it at --smoke).
RESULT_KEYS = ("benchmark", "quick", "smoke", "clients", "seconds", "requests", "rps",
               "errors", "timeouts", "targets", "status_p99_ms", "status_always_true",
               "status_false", "status_false_samples", "goals", "met")
# Its smoke run drives the lab the benchmark tests share (--lab): a lab as `make up` starts.
SMOKE_LAB: dict[str, object] = {}


def log(message: str) -> None:
    print(f"[api_load] {message}", file=sys.stderr, flush=True)


@dataclass
class Outcome:
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
    stop: threading.Event = field(default_factory=threading.Event)

    def request(self, target: str) -> Outcome:
        netloc = urllib.parse.urlsplit(self.lab.base).netloc
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
                return Outcome(target, started, ms, kind, f"HTTP {response.status}")
            try:
                truth = response.status == 200 and status_true(json.loads(body))
            except ValueError:
                truth = False
            # A 503 is status's own answer (false), not a failed request.
            kind = "error" if response.status >= 400 and response.status != 503 else "ok"
            return Outcome(target, started, ms, kind,
                           "" if truth else body.decode(errors="replace")[:300], truth)
        except TimeoutError:
            return Outcome(target, started, (time.perf_counter() - t0) * 1000, "timeout",
                           "no answer", False if target == STATUS else None)
        except (OSError, http.client.HTTPException) as exc:
            return Outcome(target, started, (time.perf_counter() - t0) * 1000, "error",
                           f"{type(exc).__name__}: {exc}"[:160],
                           False if target == STATUS else None)
        finally:
            conn.close()

    def client(self, i: int) -> None:
        n = i
        while not self.stop.is_set():
            self.outcomes.append(self.request(TARGETS[n % len(TARGETS)]))
            n += 1

    def run(self, seconds: float) -> tuple[float, float]:
        threads = [threading.Thread(target=self.client, args=(i,), daemon=True)
                   for i in range(self.clients)]
        started = time.time()
        for thread in threads:
            thread.start()
        deadline = started + seconds
        while time.time() < deadline:
            self.stop.wait(min(5.0, max(0.0, deadline - time.time())))
            done = list(self.outcomes)
            elapsed = time.time() - started
            status = [o for o in done if o.target == STATUS]
            log(f"  {elapsed:4.0f} s: {len(done)} requests ({len(done) / elapsed:.0f}/s), "
                f"{sum(o.kind != 'ok' for o in done)} failed, status p99 "
                f"{percentile([o.ms for o in status], 99):.0f} ms, "
                f"{sum(o.status_true is False for o in status)} false")
        self.stop.set()
        ended = time.time()
        for thread in threads:
            thread.join(TIMEOUT_S + 5)
        return started, ended


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 s of load")
    parser.add_argument("--smoke", action="store_true",
                        help="3 s of load: every step, not the figures")
    add_lab_option(parser)
    parser.add_argument("--no-status-lane", action="store_true",
                        help="start the lab with plain gthread web workers (status polls "
                             "queue behind other requests), for comparison; not with --lab")
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--seconds", type=float, default=None)
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
        log(f"lab up and status true after {time.monotonic() - t0:.0f} s; "
            f"{args.clients} clients for {seconds:g} s")
        load = Load(lab, dashboard_session(lab), args.clients)
        # Status alone first, one request at a time: its own cost, without the load.
        alone = [load.request(STATUS) for _ in range(5 if args.smoke else 40)]
        log(f"status alone: p50 {percentile([o.ms for o in alone], 50):.1f} ms")
        started, ended = load.run(seconds)
    elapsed = ended - started
    outcomes = [o for o in load.outcomes if o.started <= ended]
    targets = {target: summary([o for o in outcomes if o.target == target], elapsed)
               for target in TARGETS}
    status = [o for o in outcomes if o.target == STATUS]
    false = [o for o in status if o.status_true is False]
    overall = summary(outcomes, elapsed)
    status_p99 = targets[STATUS]["p99_ms"]
    met = {"status_p99_ms": status_p99 < GOALS["status_p99_ms"],
           "timeouts": overall["timeouts"] == 0, "status_false": not false}
    for target, figures in targets.items():
        log(f"{target}: {figures['rps']} req/s, p50 {figures['p50_ms']} ms, p99 "
            f"{figures['p99_ms']} ms, {figures['errors']} errors, {figures['timeouts']} timeouts")
    print(json.dumps({
        "benchmark": "api_load", "quick": args.quick, "smoke": args.smoke,
        "clients": args.clients, "seconds": round(elapsed, 1),
        "status_lane": not args.no_status_lane,
        "requests": overall["requests"], "rps": overall["rps"], "errors": overall["errors"],
        "timeouts": overall["timeouts"], "targets": targets, "status_p99_ms": status_p99,
        "status_always_true": not false and bool(status), "status_false": len(false),
        "status_false_samples": sorted({o.detail for o in false})[:3],
        "status_alone_p50_ms": round(percentile([o.ms for o in alone], 50), 1),
        "status_alone_p99_ms": round(percentile([o.ms for o in alone], 99), 1),
        "goals": GOALS, "met": met,
    }))


if __name__ == "__main__":
    main()
