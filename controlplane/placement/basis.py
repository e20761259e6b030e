"""The fleet state a plan is computed from, and what moved since.

A plan's basis is, per deployment in its scope, the rule inputs the solver reads (replica
bounds, spread, jurisdictions, spot share, latency target and users, engine layout,
demand, its tenant's caps) and the replicas it counts as running: live and not draining,
each with its state, region, offer and spot. The fingerprint is a sha256 over what the
solver reads: a replica moving between states it counts alike (pending → starting →
ready → degraded) leaves it unchanged; one that leaves (failed, terminated, draining) or
arrives, or a rule input that changes, changes it.

`differences` says what moved, in words an operator reads ("r-8 is terminated, was
ready"; "spread_regions 2 → 3"). Approving and applying a plan check it in their
transaction (controlplane.plans.freshness).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from controlplane.deployments.lifecycle import STAYING_STATES
from controlplane.deployments.models import Deployment, Replica
from controlplane.placement.models import Plan

# What of a replica the solver reads; its state is kept for the reader alone.
PLANNED_FIELDS = ("region", "offer", "spot")


def counted(deployment_ids: Iterable[int]) -> Any:
    """The replicas a plan counts as running: live, and not leaving already."""
    return Replica.objects.filter(deployment_id__in=list(deployment_ids),
                                  state__in=STAYING_STATES)


def _rules(d: Deployment) -> dict[str, Any]:
    rules: dict[str, Any] = {
        "min_replicas": d.min_replicas, "max_replicas": d.max_replicas,
        "spread_regions": d.spread_regions,
        "allowed_jurisdictions": sorted(j.code for j in d.allowed_jurisdictions.all()),
        "max_spot_fraction": d.max_spot_fraction, "slo_ttft_p95_ms": d.slo_ttft_p95_ms,
        "user_regions": sorted(r.key for r in d.user_regions.all()),
        "demand_tokens_per_s": d.demand_tokens_per_s, "model": d.model.name,
        "max_model_len": d.max_model_len, "tensor_parallel": d.tensor_parallel,
        "pipeline_parallel": d.pipeline_parallel, "engine": d.engine,
    }
    if d.tenant is not None:
        rules["tenant_max_replicas"] = d.tenant.max_replicas
        rules["tenant_max_gpus"] = d.tenant.max_gpus
    return rules


def snapshot(deployment_ids: Iterable[int]) -> dict[str, Any]:
    """The basis of a plan over these deployments, keyed by deployment name (read now)."""
    ids = list(deployment_ids)
    rows = (Deployment.objects.filter(pk__in=ids).select_related("model", "tenant")
            .prefetch_related("allowed_jurisdictions", "user_regions__cloud").order_by("name"))
    replicas: dict[int, dict[str, dict[str, Any]]] = {pk: {} for pk in ids}
    for r in counted(ids).select_related("region__cloud").order_by("pk"):
        replicas[r.deployment_id][str(r.pk)] = {
            "state": r.state, "region": r.region.key, "offer": r.offer_id, "spot": r.spot}
    return {d.name: {"id": d.pk, "rules": _rules(d), "replicas": replicas[d.pk]} for d in rows}


def fingerprint(basis: dict[str, Any]) -> str:
    """sha256 over what the solver reads of `basis` (not the replicas' states)."""
    planned = {
        name: {"id": entry["id"], "rules": entry["rules"],
               "replicas": {pk: [r[f] for f in PLANNED_FIELDS]
                            for pk, r in entry["replicas"].items()}}
        for name, entry in basis.items()}
    text = json.dumps(planned, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def record(plan: Plan, taken: dict[str, Any] | None = None) -> Plan:
    """Store on `plan` the basis `taken` (before its solve), or its scope's basis now; an
    empty scope is every deployment."""
    if taken is None:
        names = list(plan.scope or [])
        rows = Deployment.objects.filter(name__in=names) if names else Deployment.objects.all()
        taken = snapshot(rows.values_list("pk", flat=True))
    plan.basis, plan.basis_fingerprint = taken, fingerprint(taken)
    plan.save(update_fields=["basis", "basis_fingerprint"])
    return plan


def deployments_of(basis: dict[str, Any]) -> list[int]:
    return sorted(entry["id"] for entry in basis.values())


def differences(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What moved from `then` to `now` (both from `snapshot`), one line per change."""
    by_id = {entry["id"]: (name, entry) for name, entry in now.items()}
    gone_ids = [int(pk) for entry in then.values() for pk in entry["replicas"]
                if entry["id"] in by_id and pk not in by_id[entry["id"]][1]["replicas"]]
    states = dict(Replica.objects.filter(pk__in=gone_ids).values_list("pk", "state"))
    out: list[str] = []
    for name, entry in sorted(then.items()):
        if entry["id"] not in by_id:
            out.append(f"deployment {name} is gone")
            continue
        now_name, current = by_id[entry["id"]]
        if now_name != name:
            out.append(f"deployment {name} is now called {now_name}")
        out += _rule_changes(now_name, entry["rules"], current["rules"])
        out += _replica_changes(entry["replicas"], current["replicas"], states)
    return out


def _rule_changes(name: str, then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(then) | set(now)):
        was, is_ = then.get(key), now.get(key)
        if was != is_:
            out.append(f"{name}: {key} {_shown(was)} → {_shown(is_)}")
    return out


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _replica_changes(then: dict[str, dict[str, Any]], now: dict[str, dict[str, Any]],
                     states: dict[int, str]) -> list[str]:
    out = []
    for pk in sorted(set(then) | set(now), key=int):
        was, is_ = then.get(pk), now.get(pk)
        if was is not None and is_ is None:
            state = states.get(int(pk), "gone")
            out.append(f"r-{pk} is {state}, was {was['state']} in {was['region']}")
        elif was is None and is_ is not None:
            out.append(f"r-{pk} is new ({is_['state']} in {is_['region']})")
        elif was is not None and is_ is not None:
            moved = [f for f in PLANNED_FIELDS if was[f] != is_[f]]
            if moved:
                out.append(f"r-{pk}: " + ", ".join(
                    f"{f} {_shown(was[f])} → {_shown(is_[f])}" for f in moved))
    return out
