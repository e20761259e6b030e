"""Deployment rules: validation of scale bounds, parallelism, context and residency."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from django.db import transaction
from django.db.models import DateTimeField, F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from controlplane.core.models import Tier
from controlplane.deployments.models import Deployment, Model, Revision, default_engine
from regions.services import CatalogError, LoadReport, upsert

# vLLM shards attention heads across tensor-parallel ranks inside one node.
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8, 16)

_FIELDS = (
    "model", "tenant", "allowed_jurisdictions", "user_regions", "min_replicas", "max_replicas",
    "tensor_parallel", "pipeline_parallel", "max_model_len", "spread_regions",
    "max_spot_fraction", "warm_pool", "name", "demand_tokens_per_s", "slo_ttft_p95_ms",
    "engine", "shared_prefix_cache",
)
_DEFAULTS: dict[str, Any] = {
    "min_replicas": 1, "max_replicas": 4, "tensor_parallel": 1, "pipeline_parallel": 1,
    "max_model_len": 8192, "spread_regions": 1, "max_spot_fraction": 0.0,
    "allowed_jurisdictions": [], "user_regions": [], "tenant": None, "warm_pool": 0,
    "name": "", "demand_tokens_per_s": 0.0, "slo_ttft_p95_ms": 1000,
    "shared_prefix_cache": False,
}


def default_spot_fraction(tier: str) -> float:
    """The share of a new deployment's replicas that may run on spot when none is asked for:
    all of a batch tier's (a reclaimed spot replica loses no batch work: its lines are
    claimed again), none of an interactive one's."""
    return 1.0 if tier == Tier.BATCH else 0.0


def mark_unplaceable(reasons: Mapping[int, str]) -> None:
    """Record why deployments cannot be placed; the first time it happened is kept."""
    now = timezone.now()
    for pk, reason in reasons.items():
        Deployment.objects.filter(pk=pk).update(
            placement_problem=reason, placement_problem_since=Coalesce(
                F("placement_problem_since"), Value(now, output_field=DateTimeField())))


def mark_placeable(ids: Iterable[int]) -> None:
    """Clear the placement problem of deployments that were just placed."""
    Deployment.objects.filter(pk__in=list(ids)).exclude(placement_problem="").update(
        placement_problem="", placement_problem_since=None)


def merged_fields(instance: Deployment | None, attrs: dict[str, Any]) -> dict[str, Any]:
    """The deployment as it would be after applying `attrs` (a partial update) to `instance`."""
    merged: dict[str, Any] = {}
    for field in _FIELDS:
        if field in attrs:
            merged[field] = attrs[field]
        elif instance is not None and instance.pk is not None:
            value = getattr(instance, field)
            if field in ("allowed_jurisdictions", "user_regions"):
                value = list(value.all())
            merged[field] = value
        else:
            merged[field] = default_engine() if field == "engine" else _DEFAULTS.get(field)
    return merged


def tensor_parallel_error(model: Model, tp: int) -> str | None:
    if tp not in TENSOR_PARALLEL_SIZES:
        sizes = ", ".join(str(size) for size in TENSOR_PARALLEL_SIZES)
        return f"tensor_parallel must be one of {sizes}; got {tp}."
    if model.attention_heads % tp:
        return (
            f"tensor_parallel {tp} does not divide {model.name}'s "
            f"{model.attention_heads} attention heads."
        )
    if model.kv_heads % tp and tp % model.kv_heads:
        return f"tensor_parallel {tp} cannot shard {model.name}'s {model.kv_heads} KV heads."
    return None


def deployment_errors(fields: dict[str, Any]) -> dict[str, str]:
    """Field-named errors for a deployment's settings; empty when it is valid."""
    errors: dict[str, str] = {}
    model: Model | None = fields.get("model")
    low, high = fields["min_replicas"], fields["max_replicas"]
    if low is not None and high is not None and low > high:
        errors["min_replicas"] = f"min_replicas ({low}) must not exceed max_replicas ({high})."
    spread = fields["spread_regions"]
    if spread is not None and high is not None and spread > max(high, 1):
        errors["spread_regions"] = (
            f"spread_regions ({spread}) cannot exceed max_replicas ({high}): "
            "each region needs at least one replica."
        )
    warm = fields["warm_pool"]
    if warm and high is not None and warm >= high:
        errors["warm_pool"] = (
            f"warm_pool ({warm}) must be below max_replicas ({high}): idle replicas are kept "
            "beside the ones that serve demand."
        )
    if model is not None:
        tp_error = tensor_parallel_error(model, fields["tensor_parallel"])
        if tp_error:
            errors["tensor_parallel"] = tp_error
        if fields["max_model_len"] > model.max_context:
            errors["max_model_len"] = (
                f"max_model_len ({fields['max_model_len']}) exceeds {model.name}'s "
                f"maximum context of {model.max_context} tokens."
            )
    jurisdictions = list(fields["allowed_jurisdictions"] or [])
    if not jurisdictions:
        errors["allowed_jurisdictions"] = "Name at least one jurisdiction replicas may run in."
    tenant = fields.get("tenant")
    if tenant is not None and fields.get("shared_prefix_cache"):
        errors["shared_prefix_cache"] = (
            f"shared_prefix_cache is for shared deployments; this one is {tenant.name}'s own, "
            "and its cache already serves no other tenant.")
    if tenant is not None and jurisdictions:
        permitted = {j.code for j in tenant.allowed_jurisdictions.all()}
        outside = sorted(j.code for j in jurisdictions if j.code not in permitted)
        if outside:
            errors["allowed_jurisdictions"] = (
                f"Tenant {tenant.name} may not use {', '.join(outside)} "
                f"(allowed: {', '.join(sorted(permitted)) or 'none'})."
            )
    return errors


MODEL_CATALOG_PATH = Path(__file__).resolve().parent / "catalog" / "models.json"
_MODEL_FIELDS = (
    "hf_id", "family", "parameters_b", "active_parameters_b", "layers", "hidden_size",
    "attention_heads", "kv_heads", "head_dim", "dtype", "max_context", "license",
)


@transaction.atomic
def load_model_catalog(entries: list[dict[str, Any]], report: LoadReport) -> None:
    """Upsert the shipped model architectures; idempotent like the GPU catalog."""
    for i, entry in enumerate(entries):
        where = f"models[{i}]"
        missing = [
            name for name in ("name", "hf_id", "parameters_b", "layers", "attention_heads",
                              "kv_heads", "head_dim", "max_context")
            if entry.get(name) in (None, "")
        ]
        if missing:
            raise CatalogError(f"{where}: missing field(s) {', '.join(missing)}")
        if entry["attention_heads"] % entry["kv_heads"]:
            raise CatalogError(f"{where}: kv_heads must divide attention_heads")
        values = {name: entry.get(name) for name in _MODEL_FIELDS}
        values["family"] = values["family"] or ""
        values["license"] = values["license"] or ""
        values["dtype"] = values["dtype"] or "bfloat16"
        upsert(Model, {"name": entry["name"]}, values, report, "models")


def read_model_catalog(path: Path = MODEL_CATALOG_PATH) -> list[dict[str, Any]]:
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        raise CatalogError(f"model catalog not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise CatalogError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(entries, list):
        raise CatalogError(f"{path}: expected a list of models")
    return entries


def stable_revision(deployment: Deployment) -> Revision:
    """The deployment's stable revision; revision 1 from its current settings when it has
    none yet (deployments made after the revisions migration get theirs here, on first use)."""
    if deployment.stable_revision_id is not None:
        return Revision.objects.get(pk=deployment.stable_revision_id)
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if locked.stable_revision_id is None:
            number = (locked.revisions.order_by("-number").values_list("number", flat=True)
                      .first() or 0) + 1
            revision = Revision.objects.create(
                deployment=locked, number=number, model_id=locked.model_id,
                engine_args=engine_args_of(locked), tensor_parallel=locked.tensor_parallel,
                pipeline_parallel=locked.pipeline_parallel)
            Deployment.objects.filter(pk=locked.pk).update(stable_revision=revision)
            deployment.stable_revision_id = revision.pk
            return revision
        deployment.stable_revision_id = locked.stable_revision_id
        return Revision.objects.get(deployment=locked, pk=locked.stable_revision_id or 0)


def engine_args_of(deployment: Deployment) -> dict[str, Any]:
    """The engine arguments a revision records beyond model and TP/PP."""
    return {"max_model_len": deployment.max_model_len,
            "enable_prefix_caching": deployment.enable_prefix_caching,
            "engine": deployment.engine}
