"""A control plane that survives losing any one process: kill one of each during a region drill.

Starts the lab with two of each control-plane process (`python -m controlplane.lab
--replicas-of-each 2`: two gunicorn masters sharing the web port through SO_REUSEPORT, two
`control` workers, two `provision` workers, two beats), in a var dir, database, Redis
database and ports of its own, three local regions with one enginesim replica each and two
edges. Then, under API load (threads calling GET endpoints and a PATCH, every non-2xx answer
and connection error counted) and a trickle of chat through both edges (so that incidents
see traffic back and resolve):

1. undisturbed: a drill in local:us-virginia (every replica there SIGKILLed through the drill
   API); seconds from the drill to its replacements serving;
2. disturbed: a drill in local:ap-tokyo, and meanwhile one web master, one control worker,
   one provision worker and one beat are SIGKILLed, each with its whole process group
   (gunicorn's workers, Celery's pool), 0.2 to 2 s after the drill starts. The lab starts
   each again, as a process manager would; the surviving peer does the work meanwhile.

Then, from the audit log and the rows: `double_actions` (two replacements for one lost
replica, two launches of one replica, two pushes of one table version to edges that had
acked it, two applications of one plan), `lost_actions` (a lost replica with no replacement
serving 30 s after the drill, a replica stuck pending, provisioning or starting for 30 s),
`api_error_rate` while the kills happen (from the first kill to 10 s after the last), and
the two drills' times and their ratio.

    python bench/control_plane_ha.py [--quick | --smoke] [--lab FILE]

`--smoke` (the disturbed drill only, followed until its replacements serve, no 30 s wait for
lost actions) checks that every step runs, not the figures; `--lab FILE` drives a running
lab started with `--replicas-of-each 2` instead of starting one.

Every process dies with the benchmark, even when it is SIGKILLed (the lab runs under a
parent-death signal and stops its children; the lab's guard stops the engines). Progress on
stderr; one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from controlplane.lab.child_lab import (  # noqa: E402
    Lab,
    add_lab_option,
    api,
    iso_time,
    running_lab,
    wait_ready,
)
from controlplane.lab.engines import free_port  # noqa: E402

MODEL = "llama-3.1-8b"
CALM_REGION, DRILL_REGION = "local:us-virginia", "local:ap-tokyo"
LOST_AFTER_S = 30.0
# Process kinds by how the lab starts them, and when each is killed after the drill starts.
# (Celery beat renames itself "celery beat …" with setproctitle.)
KINDS = {"web": "gunicorn", "worker": "-Q control", "provisioner": "-Q provision",
         "beat": " beat "}
KILL_AT_S = {"web": 0.2, "worker": 0.6, "provisioner": 1.2, "beat": 2.0}
# What every run's JSON line holds (tests/bench/test_benchmarks.py checks it at --smoke).
RESULT_KEYS = ("benchmark", "quick", "smoke", "double_actions", "lost_actions",
               "api_error_rate", "api_calls_during_kills", "api_first_attempt_error_rate",
               "drill_s_undisturbed", "drill_s_disturbed", "drill_ratio", "kills",
               "processes_after", "double", "lost", "drills", "targets")
# Its smoke run can drive a lab another process started (--lab): one with two of each
# control-plane process.
SMOKE_LAB = {"args": ["--replicas-of-each", "2"]}


def log(message: str) -> None:
    print(f"[ha] {message}", file=sys.stderr, flush=True)


# -- the lab ----------------------------------------------------------------------------------

def relay(text: str) -> None:
    """Keep the lab's restarts visible."""
    if "starting it again" in text or "exited" in text:
        log("  lab: " + text.strip())


def lab_children(lab: Lab) -> dict[str, list[int]]:
    """The lab's control-plane processes by kind (each the leader of its process group)."""
    found: dict[str, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode() + " "
        except (OSError, IndexError, ValueError):
            continue
        if ppid != lab.pid:
            continue
        for kind, marker in KINDS.items():
            if marker in argv:
                found[kind].append(int(entry.name))
    return {kind: sorted(pids) for kind, pids in found.items()}


# -- load -------------------------------------------------------------------------------------

@dataclass
class ApiLoad:
    """Threads calling the REST API; every call's time and whether it failed."""

    lab: Lab
    threads: int = 4
    calls: list[tuple[float, bool, str]] = field(default_factory=list)
    raw: list[tuple[float, bool, str]] = field(default_factory=list)  # first attempts only
    stop: threading.Event = field(default_factory=threading.Event)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> None:
        """One call, retried once (at once) when the connection was refused or reset before an
        answer, as a load balancer in front of several web processes does; both the first
        attempt's failures and what the client finally saw are counted."""
        started = time.time()
        first = detail = ""
        for attempt in range(2):
            detail = ""
            try:
                api(method, f"{self.lab.base}{path}", self.lab.token, body)
            except urllib.error.HTTPError as exc:
                detail = f"HTTP {exc.code} {method} {path}"
            except (OSError, urllib.error.URLError, ValueError) as exc:
                detail = f"{type(exc).__name__} {method} {path}: {exc}"[:160]
            first = first if attempt else detail
            words = detail.lower()
            dropped = any(w in words for w in ("connection reset", "connectionreset",
                                               "connection refused", "remotedisconnected"))
            if not dropped:
                break
        self.calls.append((started, not detail, detail))
        self.raw.append((started, not first, first))

    def reader(self, i: int) -> None:
        paths = ["/api/v1/status/", "/api/v1/replicas/?page_size=50", "/api/v1/incidents/",
                 "/api/v1/region-health/", "/api/v1/deployments/"]
        while not self.stop.is_set():
            self.call("GET", paths[i % len(paths)])
            i += 1

    def writer(self, tenant: dict[str, Any]) -> None:
        while not self.stop.is_set():
            self.call("PATCH", f"/api/v1/tenants/{tenant['id']}/", {"name": tenant["name"]})
            self.stop.wait(0.5)

    def start(self) -> None:
        tenant = api("GET", f"{self.lab.base}/api/v1/tenants/?page_size=50",
                     self.lab.token)["results"][0]
        for i in range(self.threads):
            threading.Thread(target=self.reader, args=(i,), daemon=True).start()
        threading.Thread(target=self.writer, args=(tenant,), daemon=True).start()

    def between(self, start: float, end: float, raw: bool = False) -> tuple[int, list[str]]:
        window = [c for c in (self.raw if raw else self.calls) if start <= c[0] <= end]
        return len(window), [c[2] for c in window if not c[1]]


def chat_trickle(lab: Lab, stop: threading.Event) -> None:
    """One small chat every 0.3 s through each edge, so replacements see traffic."""
    body = json.dumps({"model": MODEL, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    while not stop.is_set():
        for client, _ in lab.edges.values():
            request = urllib.request.Request(
                f"{client}/v1/chat/completions", data=body, method="POST",
                headers={"Authorization": f"Bearer {lab.demo_key}",
                         "Content-Type": "application/json"})
            try:
                urllib.request.urlopen(request, timeout=10).read()
            except (OSError, urllib.error.URLError):
                pass
        stop.wait(0.3)


# -- drills -----------------------------------------------------------------------------------

def drill(lab: Lab, region: str, kill: bool, timeout_s: float,
          until_resolved: bool = True) -> dict[str, Any]:
    """A drill in `region` (`kill`: one of each control-plane process SIGKILLed meanwhile),
    followed until its incident is resolved, or only until the replacements serve."""
    kills: dict[str, dict[str, Any]] = {}
    incident = api("POST", f"{lab.base}/api/v1/incidents/drill/", lab.token, {"region": region})
    started = iso_time(incident["started_at"])
    if kill:
        children = lab_children(lab)
        for kind, at in sorted(KILL_AT_S.items(), key=lambda kv: kv[1]):
            time.sleep(max(0.0, started + at - time.time()))
            pids = children.get(kind, [])
            if len(pids) < 2:
                raise RuntimeError(f"expected two {kind} processes, found {pids}")
            victim = pids[0]
            os.killpg(victim, signal.SIGKILL)
            kills[kind] = {"pid": victim, "at_s": round(time.time() - started, 2)}
            log(f"  SIGKILLed {kind} (pid {victim}, with its process group) at "
                f"+{kills[kind]['at_s']} s")
    ready_at = resolved_at = None
    detail: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            detail = api("GET", f"{lab.base}/api/v1/incidents/{incident['id']}/", lab.token)
        except (OSError, urllib.error.URLError):
            time.sleep(0.25)
            continue
        if detail["replacement_ready_at"] and ready_at is None:
            ready_at = iso_time(detail["replacement_ready_at"])
            if not until_resolved:
                break
        if detail["resolved_at"]:
            resolved_at = iso_time(detail["resolved_at"])
            break
        time.sleep(0.25)
    result = {
        "region": region, "incident": incident["id"], "started": started,
        "replicas_killed": len(detail.get("failed_replicas", [])),
        "s_to_replacement_ready": None if ready_at is None else round(ready_at - started, 2),
        "s_to_resolved": None if resolved_at is None else round(resolved_at - started, 2),
        "kills": kills,
    }
    log(f"  replacements serving at +{result['s_to_replacement_ready']} s, resolved at "
        f"+{result['s_to_resolved']} s")
    return result


# -- what the rows say ------------------------------------------------------------------------

def audit_findings(lab: Lab, since: float, drills: list[dict[str, Any]]) -> dict[str, Any]:
    import psycopg

    params = urlsplit(lab.database_url)
    with psycopg.connect(host=params.hostname, port=params.port or 5432,
                         user=params.username or "postgres", password=params.password,
                         dbname=lab.database) as conn:
        rows = conn.execute(
            "SELECT action, actor, object_id, reason, changes, extract(epoch from at) "
            "FROM core_auditlog WHERE at >= to_timestamp(%s) ORDER BY id", [since]).fetchall()
        launches = conn.execute(
            "SELECT replica_id, count(*) FROM provisioning_operation WHERE kind = 'launch' "
            "AND created_at >= to_timestamp(%s) GROUP BY replica_id HAVING count(*) > 1",
            [since]).fetchall()
        stuck = conn.execute(
            "SELECT id, state FROM deployments_replica WHERE state IN "
            "('pending', 'provisioning', 'starting') AND created_at < now() - interval '30 s'"
        ).fetchall()
        incidents: dict[int, tuple[list[str], float | None, float | None]] = {}
        for drilled in drills:
            row = conn.execute(
                "SELECT failed_replicas, extract(epoch from detected_at), "
                "extract(epoch from replacement_ready_at) FROM failover_incident WHERE id = %s",
                [drilled["incident"]]).fetchone()
            if row is not None:
                incidents[drilled["incident"]] = (list(row[0]), row[1], row[2])
    # Replacements: each failover request names the replicas it replaces in its reason.
    replaced_by: Counter[str] = Counter()
    for action, actor, _, reason, _, _ in rows:
        if action == "replica.requested" and actor == "system:failover":
            for name in set(re.findall(r"r-\d+", reason.split(" in place")[0].split(" elsewhere")[0])):
                replaced_by[name] += 1
    failed = [name for failed_list, *_ in incidents.values() for name in failed_list]
    # A replacement request names every replica it replaces: n failures placed together make
    # n requests naming each, so a replica is replaced twice when it is named more often
    # than the replicas lost beside it.
    together: Counter[str] = Counter()
    for failed_list, *_ in incidents.values():
        for name in failed_list:
            together[name] = len(failed_list)
    double_replacements = sum(max(0, replaced_by[n] - together[n]) for n in failed)
    pushes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for action, _, object_id, _, changes, _ in rows:
        if action == "tables.push":
            pushes[object_id].append(changes)
    double_pushes = sum(
        1 for versions in pushes.values() for i, c in enumerate(versions)
        if i > 0 and any(not earlier.get("failed") for earlier in versions[:i]))
    applied = Counter(object_id for action, _, object_id, *_ in rows if action == "plan.applied")
    double_plans = sum(n - 1 for n in applied.values() if n > 1)
    lost = []
    for incident_id, (failed_list, detected, ready) in incidents.items():
        if failed_list and (ready is None or detected is None or ready - detected > LOST_AFTER_S):
            lost += [f"{name} (incident {incident_id})" for name in failed_list]
    lost += [f"r-{pk} stuck {state}" for pk, state in stuck]
    return {
        "double_actions": double_replacements + len(launches) + double_pushes + double_plans,
        "double": {"replacements": double_replacements, "launches": len(launches),
                   "table_pushes": double_pushes, "plan_applications": double_plans},
        "lost_actions": len(lost), "lost": lost[:10],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run that goes through every step: the disturbed "
                             "drill only, followed until its replacements serve, no wait for "
                             "lost actions")
    add_lab_option(parser, "SMOKE_LAB's arguments")
    parser.add_argument("--api-threads", type=int, default=4)
    args = parser.parse_args()
    timeout_s = 30.0 if args.smoke else 60.0 if args.quick else 120.0
    # Anything lost shows after LOST_AFTER_S; a smoke run does not wait for it.
    lost_wait_s = 0.0 if args.smoke else LOST_AFTER_S
    log("starting the lab (two of each control-plane process; 3 regions × 1 replica)"
        if args.lab is None else f"driving the lab of {args.lab}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meridian-ha-") as tmp, running_lab(
            args.lab, Path(tmp), replicas_per_region=1, name_prefix="meridian_bench_ha",
            start_timeout_s=300, on_line=relay,
            extra=["--prometheus-port", str(free_port()), *SMOKE_LAB["args"]]) as lab:
        stop = threading.Event()
        try:
            wait_ready(lab, 3)
            log(f"lab ready in {time.monotonic() - t0:.0f} s: {lab_children(lab)}")
            since = time.time()
            load = ApiLoad(lab, threads=args.api_threads)
            load.start()
            threading.Thread(target=chat_trickle, args=(lab, stop), daemon=True).start()
            time.sleep(0.5 if args.smoke else 2)
            calm: dict[str, Any] = {"s_to_replacement_ready": None, "s_to_resolved": None}
            calm_calls, calm_errors = 0, list[str]()
            if not args.smoke:
                log(f"undisturbed drill in {CALM_REGION}")
                calm = drill(lab, CALM_REGION, kill=False, timeout_s=timeout_s)
                calm_calls, calm_errors = load.between(calm["started"], time.time())
            log(f"disturbed drill in {DRILL_REGION}: one of each process SIGKILLed")
            hit = drill(lab, DRILL_REGION, kill=True, timeout_s=timeout_s,
                        until_resolved=not args.smoke)
            window = (hit["started"], hit["started"] + max(KILL_AT_S.values()) + 10)
            time.sleep(max(0.0, window[1] - time.time()))
            calls, errors = load.between(*window)
            _, raw_errors = load.between(*window, raw=True)
            load.stop.set()
            stop.set()
            # Anything lost shows after LOST_AFTER_S: wait that long past the last kill.
            time.sleep(max(0.0, hit["started"] + max(KILL_AT_S.values()) + lost_wait_s
                           - time.time()))
            findings = audit_findings(lab, since, [d for d in (calm, hit) if "incident" in d])
            restarted = lab_children(lab)
        finally:
            stop.set()

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else round(a / b, 2)

    result = {
        "benchmark": "control_plane_ha", "quick": args.quick, "smoke": args.smoke,
        "double_actions": findings["double_actions"], "lost_actions": findings["lost_actions"],
        "api_error_rate": round(len(errors) / calls, 4) if calls else None,
        "api_calls_during_kills": calls, "api_errors_during_kills": len(errors),
        "api_error_samples": sorted(set(errors))[:5],
        "api_first_attempt_error_rate": round(len(raw_errors) / calls, 4) if calls else None,
        "api_first_attempt_error_samples": sorted(set(raw_errors))[:5],
        "api_error_rate_undisturbed": round(len(calm_errors) / calm_calls, 4) if calm_calls else None,
        "drill_s_undisturbed": calm["s_to_replacement_ready"],
        "drill_s_disturbed": hit["s_to_replacement_ready"],
        "drill_ratio": ratio(hit["s_to_replacement_ready"], calm["s_to_replacement_ready"]),
        "resolved_s_undisturbed": calm["s_to_resolved"],
        "resolved_s_disturbed": hit["s_to_resolved"],
        "kills": hit["kills"], "processes_after": {k: len(v) for k, v in restarted.items()},
        "double": findings["double"], "lost": findings["lost"],
        "drills": {"undisturbed": calm, "disturbed": hit},
        "targets": {"double_actions": 0, "lost_actions": 0, "api_error_rate": 0.01},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
