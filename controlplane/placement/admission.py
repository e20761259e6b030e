"""Feasibility at the door: a deployment that no offer can ever hold is refused when it is
created or changed, with the rule it breaks in the solver's own words.

`deployment_errors` is the one check every write path uses (the REST serializer; any form
that creates or changes a deployment): the deployments layer's own rules first (bounds,
TP, context, residency against the tenant), then, when those pass, the deployment solved
alone over the offers placement may use (`proposals.offer_options`: enabled regions and
clouds, narrowed to `MERIDIAN_PLACEMENT_CLOUDS`), with nothing running and no quota. Quota
and region health change from hour to hour, so they are not reasons to refuse a deployment;
one that cannot be placed for them later shows it in its `placement_problem`.

Where the engine's layout is the only problem and a larger one fits, the answer says which
(`tp 2 fits`), so the fix is one field away.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from controlplane.deployments import caps
from controlplane.deployments import services as deployment_rules
from controlplane.deployments.models import ENGINE_CLOUDS
from controlplane.placement import explain
from controlplane.placement.capacity import MAX_PIPELINE_NODES
from controlplane.placement.fleet import Fleet
from controlplane.placement.problem import DeploymentRequest, OfferOption, PlacementProblem
from controlplane.placement.proposals import offer_options, spec_of
from controlplane.placement.search import solve

# Seconds one check may spend in the solver: a deployment alone, without quota, is small.
TIME_LIMIT_S = 5.0
# The words of explain.RELAXABLE's groups, and the deployment field each one is.
_RELAXED_FIELDS = (
    ("its spread over", "spread_regions"),
    ("its spot share", "max_spot_fraction"),
    ("its max_replicas", "max_replicas"),
    ("its min_replicas", "min_replicas"),
    ("its demand", "demand_tokens_per_s"),
)


def deployment_errors(fields: Mapping[str, Any], deployment_id: int | None = None
                      ) -> dict[str, str]:
    """Field-named errors for a deployment's settings (as `deployments.services.
    merged_fields` gives them; `deployment_id`: the row they change, if any); empty when it
    is valid, within the replica bounds and its tenant's caps (`deployments.caps`), and some
    offer can hold it."""
    errors = deployment_rules.deployment_errors(dict(fields))
    for field, words in caps.door_errors(fields, deployment_id).items():
        errors.setdefault(field, words)
    if errors or fields.get("model") is None:
        return errors
    request = request_for(fields)
    offers = offer_options()
    if request.allowed_clouds and not any(o.cloud in request.allowed_clouds for o in offers):
        return {"engine": f"{fields.get('engine')} runs only on "
                          f"{', '.join(sorted(request.allowed_clouds))} regions, and placement "
                          "may use none here; use engine vllm"}
    return placement_errors(request, offers)


def request_for(fields: Mapping[str, Any], deployment_id: int = 0) -> DeploymentRequest:
    """The solver's view of a deployment's settings, saved or not."""
    return DeploymentRequest(
        id=deployment_id, name=fields.get("name") or "this deployment",
        model=spec_of(fields["model"]), context=int(fields["max_model_len"]),
        tokens_per_s=float(fields.get("demand_tokens_per_s") or 0.0),
        min_replicas=int(fields["min_replicas"]), max_replicas=int(fields["max_replicas"]),
        allowed_jurisdictions=frozenset(j.code for j in fields["allowed_jurisdictions"]),
        spread_regions=int(fields["spread_regions"] or 1),
        max_spot_fraction=float(fields["max_spot_fraction"] or 0.0),
        ttft_slo_ms=float(fields.get("slo_ttft_p95_ms") or 1000),
        user_locations=tuple((r.latitude, r.longitude) for r in fields["user_regions"] or ()),
        tensor_parallel=int(fields["tensor_parallel"]),
        pipeline_parallel=int(fields["pipeline_parallel"]),
        allowed_clouds=ENGINE_CLOUDS.get(fields.get("engine") or "", frozenset()),
    )


def placement_errors(d: DeploymentRequest, offers: Sequence[OfferOption]) -> dict[str, str]:
    """Why no plan can ever place `d` on `offers`, by the field the rule binds on."""
    found = _why_not(d, offers)
    if found is None:
        return {}
    field, words = found
    if field == "tensor_parallel":
        layout = _layout_that_fits(d, offers)
        if layout is not None:
            tp, pp = layout
            if pp == d.pipeline_parallel:
                return {"tensor_parallel": f"{words}; tp {tp} fits"}
            return {"pipeline_parallel": f"{words}; tp {tp} × pp {pp} fits"}
    return {field: words}


def _why_not(d: DeploymentRequest, offers: Sequence[OfferOption]) -> tuple[str, str] | None:
    problem = PlacementProblem((d,), tuple(offers), {}, (), time_limit_s=TIME_LIMIT_S)
    fleet = Fleet.prepare(problem)
    static = explain.precheck_each(problem, fleet.blocks, fleet.index).get(d.id)
    if static:
        field, words = static[0]
        return ("spread_regions" if field == "spread_clouds" else field), words
    result = solve(problem)
    if result.has_plan:
        return None
    words = "; ".join(result.explanation) or f"the solver found no plan ({result.status})"
    for phrase, field in _RELAXED_FIELDS:
        if phrase in words:
            return field, words
    return "min_replicas", words


def _layout_that_fits(d: DeploymentRequest, offers: Sequence[OfferOption]
                      ) -> tuple[int, int] | None:
    """The smallest engine that some offer holds: a larger TP alone first, then TP × PP
    with the fewest GPUs and stages."""
    layouts = sorted(
        ((tp, pp) for tp in deployment_rules.TENSOR_PARALLEL_SIZES
         for pp in range(1, MAX_PIPELINE_NODES + 1)
         if tp * pp > d.tensor_parallel * d.pipeline_parallel),
        key=lambda tp_pp: (tp_pp[1] != d.pipeline_parallel, tp_pp[0] * tp_pp[1], tp_pp[1]))
    for tp, pp in layouts:
        if pp > d.model.layers:
            continue
        bigger = dataclasses.replace(d, tensor_parallel=tp, pipeline_parallel=pp)
        if _why_not(bigger, offers) is None:
            return tp, pp
    return None
