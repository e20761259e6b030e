"""Canary rollouts under load: a good revision promoted through every step, a bad one rolled
back by the analysis alone.

Starts the lab (`python -m controlplane.lab`: control plane, workers, beat, three local
regions of enginesim replicas, two edges) against a database and Redis database of its own,
then sends multi-turn chat conversations (streaming, each turn repeating the conversation so
far) through the Frankfurt edge while two rollouts of the demo deployment run:

1. good: a new vLLM version, steps 10 → 50 → 100 %. The rollout advances itself as each
   step's analysis passes, and is promoted by it once the 100 % step has passed (the
   rollout's default `auto_promote`); nobody acts.
2. bad: another revision, steps 10 → 50 → 100 %, whose canary replica is made slow (an
   enginesim fault: every step `--bad-factor` times as long, so its TTFT and ITL grow) or
   failing (`--bad-fault fail`: 500 to every request) as soon as it is up. Nobody acts: the
   analysis rolls it back.

Reported: `good_promoted`, `good_failed_requests` (requests of the good phase that did not
answer 200 with a whole stream), `good_old_replicas_after` (the states, at the end, of the
old revision's replicas the promotion retired: terminated), `bad_rolled_back`, `s_to_rollback` (from the bad step's
start, its rollout's creation, to the rollback; it includes the canary replica's start) and
`s_fault_to_rollback` (from the first request the bad canary served), `s_rollback_to_alert` (to the
`rollout_rolled_back` alert, evaluated every 10 s), `bad_canary_replicas_after` (their
states once the alert is open: draining or terminated), `bad_request_share`
(requests the bad revision took — answered by its replica, or refused by the edge for it once
that replica was ejected — ÷ all requests from the bad phase's first request to 3 s after
the rollback), `sticky_share` (conversations whose turns were all served by one
revision ÷ conversations with at least two answered turns, counting the good phase and the
bad phase's conversations that ended before the rollback: after it, the canary's
conversations move to the stable revision by design).

    python bench/rollout.py [--quick | --smoke] [--bad-fault slow|fail] [--lab FILE]

`--smoke` (steps 50 → 100 %, 1 s bake) checks that every step runs, not the figures;
`--lab FILE` drives a running lab instead of starting one (controlplane.lab.child_lab).

Progress on stderr; one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from failover import MODELS  # noqa: E402

from controlplane.lab.child_lab import (  # noqa: E402
    Lab,
    add_lab_option,
    api,
    attach_lab,
    edge_replicas,
    engine_client_context,
    iso_time,
    start_lab,
    stop_lab,
    wait_ready,
)
from controlplane.lab.waiting import wait_until  # noqa: E402

DEPLOYMENT = "demo-chat"  # controlplane.lab.fleet.DEMO_DEPLOYMENT
MODEL = MODELS["enginesim"]
EDGE = "local:eu-frankfurt"
# What every run's JSON line holds (tests/bench/test_benchmarks.py checks it at --smoke).
RESULT_KEYS = ("benchmark", "quick", "smoke", "bake_s", "steps", "concurrency", "bad_fault",
               "good_promoted", "good_failed_requests", "good_requests",
               "good_old_replicas_after", "bad_rolled_back", "s_to_rollback",
               "s_fault_to_rollback", "s_rollback_to_alert", "bad_canary_replicas_after",
               "bad_request_share", "first_step_share", "sticky_share", "targets")
# Its smoke run can drive a lab another process started (--lab) with the lab's defaults.
SMOKE_LAB: dict[str, object] = {}
SYSTEM = "You are a concise assistant for a travel company. Answer in one sentence."


def log(message: str) -> None:
    print(f"[rollout] {message}", file=sys.stderr, flush=True)


def replica_revisions(lab: Lab) -> dict[str, str]:
    """Replica id → revision id, from every edge's replica list (set while a rollout
    splits the model)."""
    out: dict[str, str] = {}
    for _, admin in lab.edges.values():
        for replica in edge_replicas(lab, admin):
            if replica.get("revision"):
                out[replica["id"]] = replica["revision"]
    return out


def wait_for_canary(lab: Lab, revision: int, timeout_s: float) -> str:
    """The canary replica's URL, once every edge routes to it and the API has it ready."""
    def canary_url() -> str:
        ids = [{r["id"] for r in edge_replicas(lab, admin)
                if r.get("revision") == str(revision) and r.get("state") == "ready"}
               for _, admin in lab.edges.values()]
        if not all(ids):
            return ""
        replicas = api("GET", f"{lab.base}/api/v1/replicas/?state=ready&page_size=100",
                       lab.token)["results"]
        canaries = [r for r in replicas if r["public_id"] in ids[0]]
        if not canaries:
            return ""
        log(f"  canary replica {canaries[0]['public_id']} serving in "
            f"{canaries[0].get('region')}")
        return str(canaries[0]["url"])

    return wait_until(canary_url, timeout_s,
                      f"every edge to route to revision {revision}'s ready replica",
                      every_s=0.25, ignore=(OSError,))


# -- load -------------------------------------------------------------------------------------

@dataclass
class Turn:
    conversation: int
    started: float
    ended: float = 0.0
    ok: bool = False
    replica: str = ""
    detail: str = ""


@dataclass
class Conversations:
    url: str
    key: str
    concurrency: int
    turns: list[Turn] = field(default_factory=list)
    running: bool = True
    next_id: int = 0

    async def turn(self, session: aiohttp.ClientSession, conversation: int,
                   messages: list[dict[str, str]]) -> str:
        turn = Turn(conversation, time.time())
        text: list[str] = []
        try:
            async with session.post(
                    f"{self.url}/v1/chat/completions",
                    json={"model": MODEL, "messages": messages, "max_tokens": 12,
                          "stream": True, "temperature": 0},
                    headers={"Authorization": f"Bearer {self.key}"},
                    timeout=aiohttp.ClientTimeout(total=30)) as response:
                turn.replica = response.headers.get("x-meridian-replica", "")
                raw = await response.read()
                if response.status != 200:
                    turn.detail = f"HTTP {response.status}: {raw[:120]!r}"
                else:
                    turn.ok = b"data: [DONE]" in raw
                    turn.detail = "" if turn.ok else "stream ended without [DONE]"
                    for line in raw.split(b"\n"):
                        if line.startswith(b"data: {"):
                            for choice in json.loads(line[6:]).get("choices") or []:
                                text.append((choice.get("delta") or {}).get("content") or "")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            turn.detail = f"{type(exc).__name__}: {exc}"[:160]
        turn.ended = time.time()
        self.turns.append(turn)
        return "".join(text)

    async def worker(self, session: aiohttp.ClientSession) -> None:
        while self.running:
            conversation = self.next_id
            self.next_id += 1
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"Trip {conversation}: where should I go "
                                                    f"in month {conversation % 12 + 1}?"}]
            answer = await self.turn(session, conversation, messages)
            messages += [{"role": "assistant", "content": answer or "Lisbon."},
                         {"role": "user", "content": "And for how many days?"}]
            await self.turn(session, conversation, messages)

    async def run(self, stop: asyncio.Event) -> None:
        connector = aiohttp.TCPConnector(limit=self.concurrency * 2)
        async with aiohttp.ClientSession(connector=connector) as session:
            tasks = [asyncio.create_task(self.worker(session)) for _ in range(self.concurrency)]
            await stop.wait()
            self.running = False
            await asyncio.gather(*tasks)


# -- one rollout --------------------------------------------------------------------------------

@dataclass
class Phase:
    rollout: dict[str, Any]
    turns: list[Turn]
    revisions: dict[str, str]  # replica id → revision id
    canary_ready_at: float
    first_canary_turn: float | None = None


def steps_of(rollout: dict[str, Any]) -> list[tuple[int, str, str]]:
    return [(s["weight"], s["decision"], (s.get("analysis") or {}).get("verdict", ""))
            for s in rollout["step_rows"]]


def start_rollout(lab: Lab, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST the rollout, once the deployment takes one: the API answers 409 while the last
    promotion still retires the old revision's replicas (make-before-break)."""
    started = time.monotonic()

    def created() -> dict[str, Any] | None:
        try:
            return dict(api("POST", f"{lab.base}/api/v1/rollouts/", lab.token, body))
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise
            return None

    rollout = wait_until(created, timeout_s, f"the deployment {DEPLOYMENT} to take a new "
                         "rollout (409 while the last promotion retires replicas)", every_s=1.0)
    if time.monotonic() - started > 1.0:
        log(f"  the deployment took the rollout after {time.monotonic() - started:.0f} s "
            "(the last promotion was still retiring the old revision's replicas)")
    return rollout


async def run_phase(lab: Lab, *, vllm_version: str, steps: list[int], bake_s: int,
                    concurrency: int, fault: dict[str, Any] | None, timeout_s: float) -> Phase:
    body = {"deployment": DEPLOYMENT, "steps": steps, "bake_s": bake_s,
            "vllm_version": vllm_version, "reason": "bench/rollout.py",
            "thresholds": {"min_requests": 10, "max_extensions": 10}}
    rollout = await asyncio.to_thread(start_rollout, lab, body, 180.0)
    rid, canary = rollout["id"], rollout["to_revision"]["id"]
    log(f"rollout {rid}: revision {rollout['from_revision']['number']} → "
        f"{rollout['to_revision']['number']} ({vllm_version}); waiting for its canary replica")
    url = await asyncio.to_thread(wait_for_canary, lab, canary, 60.0)
    if fault is not None:
        request = urllib.request.Request(f"{url}/sim/faults", data=json.dumps(fault).encode(),
                                         method="POST",
                                         headers={"Content-Type": "application/json"})
        context = engine_client_context(lab) if url.startswith("https:") else None
        await asyncio.to_thread(urllib.request.urlopen, request, timeout=5, context=context)
        log(f"canary {url} given the fault {fault}")
    ready_at = time.time()
    revisions = await asyncio.to_thread(replica_revisions, lab)
    load = Conversations(lab.edges[EDGE][0], lab.demo_key, concurrency)
    stop = asyncio.Event()
    task = asyncio.create_task(load.run(stop))
    deadline = time.monotonic() + timeout_s
    shown: list[tuple[int, str, str]] = []
    rolled_back_at: float | None = None
    try:
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            rollout = await asyncio.to_thread(api, "GET", f"{lab.base}/api/v1/rollouts/{rid}/",
                                              lab.token)
            decided = steps_of(rollout)
            if decided != shown:
                log(f"  steps (weight, decision, verdict): {decided}")
                shown = decided
            if rollout["state"] == "rolled_back":
                if rolled_back_at is None:
                    rolled_back_at = time.monotonic()
                    log(f"  rolled back: {rollout['reason'][:200]}")
                if time.monotonic() - rolled_back_at >= 3.0:
                    break  # requests have gone back to the stable revision
            elif rollout["state"] != "running":
                break  # promoted by the analysis once its last step passed, or held
        else:
            raise RuntimeError(f"rollout {rid} still {rollout['state']} after {timeout_s:.0f} s")
    finally:
        stop.set()
        await task
    revisions.update(await asyncio.to_thread(replica_revisions, lab))
    if rollout["state"] == "promoted":
        log(f"  promoted by the analysis: {steps_of(rollout)}")
    phase = Phase(rollout, load.turns, revisions, ready_at)
    on_canary = [t.started for t in load.turns if revisions.get(t.replica) == str(canary)]
    phase.first_canary_turn = min(on_canary) if on_canary else None
    return phase


def retired_by_promotion(lab: Lab, rollout: dict[str, Any]) -> list[str]:
    """The states of the old revision's replicas the promotion retired (drained once the
    new revision's serve: draining, then terminated)."""
    events = api("GET", f"{lab.base}/api/v1/audit-log/?action=rollout.promoted"
                        f"&object_id={rollout['id']}", lab.token)["results"]
    retired = set(events[0]["changes"].get("retired") or []) if events else set()
    replicas = api("GET", f"{lab.base}/api/v1/replicas/?page_size=100", lab.token)["results"]
    return sorted(r["state"] for r in replicas if r["public_id"] in retired)


def after_rollback(lab: Lab, rollout: dict[str, Any], timeout_s: float = 20.0
                   ) -> tuple[float | None, list[str]]:
    """Seconds from the rollback to the open `rollout_rolled_back` alert (alerts are
    evaluated every 10 s), and the canary replicas' states then."""
    ended = iso_time(rollout["ended_at"])
    subject = f"rollout {rollout['id']}"
    alert_s = None
    deadline = time.monotonic() + timeout_s
    while alert_s is None and time.monotonic() < deadline:
        alerts = api("GET", f"{lab.base}/api/v1/alerts/?rule=rollout_rolled_back&state=open",
                     lab.token)["results"]
        found = [a for a in alerts if a["subject"] == subject]
        if found:
            alert_s = round(iso_time(found[0]["opened_at"]) - ended, 2)
        else:
            time.sleep(0.5)
    events = api("GET", f"{lab.base}/api/v1/audit-log/?action=rollout.rolled_back"
                        f"&object_id={rollout['id']}", lab.token)["results"]
    canaries = set(events[0]["changes"].get("retired", [])) if events else set()
    replicas = api("GET", f"{lab.base}/api/v1/replicas/?page_size=100", lab.token)["results"]
    return alert_s, sorted(r["state"] for r in replicas if r["public_id"] in canaries)


def sticky(phases: list[Phase]) -> tuple[int, int]:
    """(conversations on one revision, conversations with two answered turns)."""
    stayed = counted = 0
    for phase in phases:
        ended = phase.rollout.get("ended_at")
        cutoff = (iso_time(ended) if ended and phase.rollout["state"] == "rolled_back"
                  else float("inf"))
        served: dict[int, list[Turn]] = defaultdict(list)
        for turn in phase.turns:
            served[turn.conversation].append(turn)
        for turns in served.values():
            answered = [t for t in turns if t.ok and t.replica in phase.revisions]
            if len(answered) < 2 or max(t.ended for t in turns) >= cutoff:
                continue
            counted += 1
            stayed += len({phase.revisions[t.replica] for t in answered}) == 1
    return stayed, counted


def lift_rate_limits(lab: Lab) -> None:
    """The demo tenant's RPM and TPM limits out of the way: the load is the point here."""
    tenants = api("GET", f"{lab.base}/api/v1/tenants/?page_size=100", lab.token)["results"]
    demo = next(t for t in tenants if t["name"] == "demo")
    api("PATCH", f"{lab.base}/api/v1/tenants/{demo['id']}/", lab.token,
        {"rpm_limit": 1_000_000, "tpm_limit": 1_000_000_000})
    time.sleep(3)  # the next tables carry them to the edges


def start_with_retries(var_dir: Path, tries: int = 3) -> Lab:
    """The lab; started again when it exits while starting (another lab on this machine
    took one of the ports it had found free)."""
    for attempt in range(1, tries + 1):
        try:
            return start_lab(var_dir / str(attempt), "enginesim", replicas_per_region=1,
                             name_prefix="meridian_bench_rollout")
        except RuntimeError as exc:
            if attempt == tries or "exited while starting" not in str(exc):
                raise
            log(f"{exc}; starting it again")
    raise AssertionError("unreachable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run that goes through every step: two steps "
                             "(50, 100 %%) of a second's bake each")
    add_lab_option(parser)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--bad-fault", choices=("slow", "fail"), default="slow")
    parser.add_argument("--bad-factor", type=float, default=4.0,
                        help="how much slower the bad canary's engine steps are (slow)")
    args = parser.parse_args()
    bake_s = 1 if args.smoke else 4 if args.quick else 30
    steps = [50, 100] if args.smoke else [10, 50, 100]
    fault = ({"mode": "slow", "factor": args.bad_factor} if args.bad_fault == "slow"
             else {"mode": "fail", "status": 500, "health": False})
    with tempfile.TemporaryDirectory(prefix="meridian-rollout-") as tmp:
        log("starting the lab (3 local regions × 1 enginesim replica, 2 edges)"
            if args.lab is None else f"driving the lab of {args.lab}")
        began = time.monotonic()
        lab = start_with_retries(Path(tmp)) if args.lab is None else attach_lab(args.lab)
        try:
            wait_ready(lab, 3)
            lift_rate_limits(lab)
            log(f"lab ready in {time.monotonic() - began:.0f} s")
            shown = "/".join(map(str, steps))
            log(f"good revision: steps {shown} %, bake {bake_s} s each")
            good = asyncio.run(run_phase(lab, vllm_version="0.11.1", steps=steps, bake_s=bake_s,
                                         concurrency=args.concurrency, fault=None,
                                         timeout_s=120))
            log(f"bad revision ({args.bad_fault}): steps {shown} %, bake {bake_s} s each")
            bad = asyncio.run(run_phase(lab, vllm_version="0.11.2", steps=steps, bake_s=bake_s,
                                        concurrency=args.concurrency, fault=fault,
                                        timeout_s=120))
            alert_s, canary_states = (after_rollback(lab, bad.rollout)
                                      if bad.rollout["state"] == "rolled_back" else (None, []))
            log(f"alert opened {alert_s} s after the rollback; canary replicas {canary_states}")
            old_states = retired_by_promotion(lab, good.rollout)
            log(f"the good promotion's old revision replicas: {old_states}")
        finally:
            if args.lab is None:
                stop_lab(lab)
    good_failed = [t for t in good.turns if not t.ok]
    bad_rollout = bad.rollout
    bad_revision = str(bad_rollout["to_revision"]["id"])
    rolled_back = bad_rollout["state"] == "rolled_back"
    ended = iso_time(bad_rollout["ended_at"]) if bad_rollout.get("ended_at") else None
    # Requests the bad revision took: answered by one of its replicas, or refused by the
    # edge for it (no replica header: its replica ejected; the stable ones never fail here).
    bad_served = sum(1 for t in bad.turns if bad.revisions.get(t.replica) == bad_revision
                     or (not t.replica and not t.ok))
    stayed, counted = sticky([good, bad])
    result = {
        "benchmark": "rollout", "quick": args.quick, "smoke": args.smoke, "bake_s": bake_s,
        "steps": steps,
        "concurrency": args.concurrency, "bad_fault": fault,
        "good_promoted": good.rollout["state"] == "promoted"
                         and [d for _, d, _ in steps_of(good.rollout)]
                         == ["advanced"] * (len(steps) - 1) + ["promoted"],
        "good_failed_requests": len(good_failed),
        "good_requests": len(good.turns),
        "good_old_replicas_after": old_states,
        "bad_rolled_back": rolled_back and bad_rollout["ended_by"] == "rollouts.analysis",
        "s_to_rollback": round(ended - iso_time(bad_rollout["started_at"]), 2) if ended else None,
        "s_fault_to_rollback": (round(ended - bad.first_canary_turn, 2)
                                if ended and bad.first_canary_turn else None),
        "s_rollback_to_alert": alert_s,
        "bad_canary_replicas_after": canary_states,
        "bad_request_share": round(bad_served / len(bad.turns), 4) if bad.turns else None,
        "first_step_share": steps[0] / 100,
        "bad_phase_requests": len(bad.turns),
        "sticky_share": round(stayed / counted, 4) if counted else None,
        "conversations_counted": counted,
        "bad_reason": bad_rollout["reason"],
        "good_steps": steps_of(good.rollout), "bad_steps": steps_of(bad_rollout),
        "good_errors": sorted({t.detail for t in good_failed})[:5],
        "bad_phase_failed_requests": sum(1 for t in bad.turns if not t.ok),
        "bad_errors": sorted({t.detail[:80] for t in bad.turns if not t.ok})[:5],
        "wall_s": round(time.monotonic() - began, 1),
        "targets": {"good_failed_requests": 0, "s_to_rollback": 30.0,
                    "bad_request_share": 0.12, "sticky_share": 0.95},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
