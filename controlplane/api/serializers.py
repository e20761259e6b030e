"""Serializers for the REST API's resources: tenants and keys, models and deployments,
replicas, the audit log, status, edges, the routing policy and provider operations. The
catalog's (clouds, regions, GPU types, offers, quota) are `catalog_serializers.py`."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers
from rest_framework.exceptions import PermissionDenied

from controlplane.api.fields import RegionKeyField, refuse_numeric_name
from controlplane.api.strict_input import StrictModelSerializer
from controlplane.core.models import ApiKey, AuditLog, Tenant, Tier
from controlplane.core.redaction import operation_summary, redact_addresses
from controlplane.core.services import (
    RevocationFinal,
    issue_api_key,
    principal_for,
    set_key_revoked,
)
from controlplane.deployments import services as deployment_services
from controlplane.deployments.models import Deployment, Model, Replica
from controlplane.placement import admission
from controlplane.placement import rules as placement_rules
from controlplane.provisioning.models import Operation
from controlplane.routing import names as routing_names
from controlplane.routing.models import Edge, RoutingPolicy
from regions.models import Jurisdiction


class TenantSerializer(StrictModelSerializer):
    allowed_jurisdictions = serializers.SlugRelatedField(
        slug_field="code", queryset=Jurisdiction.objects.all(), many=True, required=False
    )
    allowed_regions = RegionKeyField(many=True, required=False)

    class Meta:
        model = Tenant
        fields = [
            "id", "name", "display_name", "allowed_jurisdictions", "allowed_regions",
            "rpm_limit", "tpm_limit", "monthly_budget_usd", "resume_streams", "max_replicas",
            "max_gpus", "created_at",
        ]
        read_only_fields = ["created_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        jurisdictions = attrs.get("allowed_jurisdictions")
        regions = attrs.get("allowed_regions")
        if jurisdictions is None and self.instance is not None:
            jurisdictions = list(self.instance.allowed_jurisdictions.all())
        if regions and jurisdictions is not None:
            codes = {j.code for j in jurisdictions}
            outside = [r.key for r in regions if r.jurisdiction.code not in codes]
            if outside:
                raise serializers.ValidationError(
                    {"allowed_regions": f"Outside the tenant's jurisdictions: {', '.join(outside)}."}
                )
        return attrs


class _TenantOwned(StrictModelSerializer):
    """Tenant users may only create rows for their own tenant; it is filled in for them."""

    def _principal_tenant_id(self) -> int | None:
        request = self.context.get("request")
        return principal_for(request.user).tenant_id if request else None

    def validate_tenant(self, value: Tenant | None) -> Tenant | None:
        own = self._principal_tenant_id()
        if own is None:
            return value
        if value is None:
            return Tenant.objects.get(pk=own)
        if value.pk != own:
            raise serializers.ValidationError("You may only use your own tenant.")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        own = self._principal_tenant_id()
        if own is not None and self.instance is None and attrs.get("tenant") is None:
            attrs["tenant"] = Tenant.objects.get(pk=own)
        return attrs


class ApiKeySerializer(_TenantOwned):
    tenant = serializers.SlugRelatedField(slug_field="name", queryset=Tenant.objects.all())
    key = serializers.SerializerMethodField(
        help_text="The key itself, returned once on creation and null ever after."
    )
    allowed_models = serializers.ListField(
        child=serializers.CharField(max_length=96), required=False, max_length=100
    )
    revoked = serializers.BooleanField(required=False, write_only=True)

    class Meta:
        model = ApiKey
        fields = [
            "id", "tenant", "name", "prefix", "tier", "allowed_models", "created_at",
            "revoked_at", "revoked_by", "revoked_by_platform", "revoked", "key",
        ]
        read_only_fields = ["prefix", "created_at", "revoked_at", "revoked_by",
                            "revoked_by_platform"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs = super().validate(attrs)
        if self.instance is not None and "tenant" in attrs and attrs["tenant"] != self.instance.tenant:
            raise serializers.ValidationError({"tenant": "A key cannot move between tenants."})
        return attrs

    def create(self, validated_data: dict[str, Any]) -> ApiKey:
        validated_data.pop("revoked", None)
        row, key = issue_api_key(
            validated_data["tenant"], validated_data["name"],
            validated_data.get("tier", Tier.INTERACTIVE), validated_data.get("allowed_models"),
        )
        row.plaintext_key = key  # type: ignore[attr-defined]
        return row

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_key(self, obj: ApiKey) -> str | None:
        return getattr(obj, "plaintext_key", None)

    def update(self, instance: ApiKey, validated_data: dict[str, Any]) -> ApiKey:
        revoked = validated_data.pop("revoked", None)
        if revoked is not None:
            request = self.context["request"]
            try:
                set_key_revoked(instance, revoked, principal_for(request.user))
            except RevocationFinal as exc:
                raise PermissionDenied({"revoked": str(exc)}) from None
        return super().update(instance, validated_data)


# An LLM's architecture (deployments.Model), named apart from DRF's ModelSerializer; the
# schema keeps calling it Model.
@extend_schema_serializer(component_name="Model")
class LlmModelSerializer(StrictModelSerializer):
    class Meta:
        model = Model
        fields = [
            "id", "name", "hf_id", "family", "parameters_b", "active_parameters_b", "layers",
            "hidden_size", "attention_heads", "kv_heads", "head_dim", "dtype", "max_context",
            "license",
        ]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        heads = attrs.get("attention_heads", getattr(self.instance, "attention_heads", None))
        kv_heads = attrs.get("kv_heads", getattr(self.instance, "kv_heads", None))
        if heads and kv_heads and heads % kv_heads:
            raise serializers.ValidationError(
                {"kv_heads": f"kv_heads ({kv_heads}) must divide attention_heads ({heads})."}
            )
        return attrs


class _DeploymentList(serializers.ListSerializer):
    """A page of deployments, their rule violations read for the whole page at once."""

    def to_representation(self, data: Any) -> list[Any]:
        items = list(data.all() if hasattr(data, "all") else data)
        # The child's context is this serializer's own dict (DRF reads it from the root).
        context = self.child.context if self.child is not None else None
        if isinstance(context, dict):
            context["rule_violations"] = placement_rules.rule_violations(items)
        return super().to_representation(items)


class DeploymentSerializer(_TenantOwned):
    model = serializers.SlugRelatedField(slug_field="name", queryset=Model.objects.all())
    tenant = serializers.SlugRelatedField(
        slug_field="name", queryset=Tenant.objects.all(), allow_null=True, required=False
    )
    allowed_jurisdictions = serializers.SlugRelatedField(
        slug_field="code", queryset=Jurisdiction.objects.all(), many=True
    )
    user_regions = RegionKeyField(many=True, required=False)
    replicas_ready = serializers.IntegerField(read_only=True, default=0)
    placement_status = serializers.ChoiceField(
        choices=["placeable", "unplaceable"], read_only=True,
        help_text="unplaceable: the last attempt to place it failed (placement_problem says "
                  "why); settings no offer can ever hold are refused with 400 instead.")
    rule_violations = serializers.SerializerMethodField(
        help_text="The placement rules its serving replicas break now, in words (spread, "
                  "residency, latency): e.g. \"spread_regions 3, serving in 1 region "
                  "(aws:eu-central-1)\". Empty when it keeps them all.")

    class Meta:
        model = Deployment
        list_serializer_class = _DeploymentList
        fields = [
            "id", "name", "served_model_name", "model", "tenant", "tier",
            "allowed_jurisdictions", "user_regions", "slo_ttft_p95_ms", "slo_itl_p95_ms",
            "min_replicas", "max_replicas", "spread_regions", "max_spot_fraction",
            "demand_tokens_per_s", "tensor_parallel", "pipeline_parallel", "max_model_len",
            "enable_prefix_caching", "shared_prefix_cache", "engine", "disaggregated_prefill",
            "auto_apply_plans",
            "autoscale", "target_inflight_per_replica", "warm_pool", "scale_up_cooldown_s",
            "scale_down_cooldown_s", "replicas_ready", "placement_status",
            "placement_problem", "placement_problem_since", "rule_violations", "created_at",
            "updated_at",
        ]
        read_only_fields = ["placement_problem", "placement_problem_since", "created_at",
                            "updated_at"]
        extra_kwargs = {"max_spot_fraction": {"help_text": (
            "Share of the replicas that may run on spot capacity (0–1). Default: 1 for the "
            "batch tier (a reclaimed spot replica's batch lines are claimed again), 0 for "
            "interactive.")}}

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_rule_violations(self, obj: Deployment) -> list[str]:
        known = self.context.get("rule_violations")
        found = known.get(obj.pk) if known is not None else None
        if found is None:
            found = placement_rules.rule_violations([obj])[obj.pk]
        return [str(v) for v in found]

    def validate_name(self, value: str) -> str:
        return refuse_numeric_name(value)

    def validate_served_model_name(self, value: str) -> str:
        problem = routing_names.served_name_problem(value)
        if problem:
            raise serializers.ValidationError(problem)
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs = super().validate(attrs)
        if self.instance is None and "max_spot_fraction" not in attrs:
            attrs["max_spot_fraction"] = deployment_services.default_spot_fraction(
                attrs.get("tier", Tier.INTERACTIVE))
        merged = deployment_services.merged_fields(self.instance, attrs)
        errors = admission.deployment_errors(merged, self.instance.pk if self.instance else None)
        if errors:
            raise serializers.ValidationError(errors)
        return attrs

    def update(self, instance: Deployment, validated_data: dict[str, Any]) -> Deployment:
        # The problem was found with the old settings; the next placement finds the new one.
        validated_data.update(placement_problem="", placement_problem_since=None)
        return super().update(instance, validated_data)


class _PlatformDetail(StrictModelSerializer):
    """A serializer some of whose fields are platform data (controlplane/core/redaction.py):
    tenant users get `platform_blank` fields empty, and `platform_redacted` ones with every
    address hidden. Without a request (internal use) nothing is hidden."""

    platform_blank: tuple[str, ...] = ()
    platform_redacted: tuple[str, ...] = ()

    def for_platform(self) -> bool:
        request = self.context.get("request")
        return request is None or principal_for(request.user).is_platform

    def to_representation(self, instance: Any) -> Any:
        data = super().to_representation(instance)
        if not self.for_platform():
            for name in self.platform_blank:
                if name in data:
                    data[name] = ""
            for name in self.platform_redacted:
                if data.get(name):
                    data[name] = redact_addresses(data[name])
        return data


class ReplicaSerializer(_PlatformDetail):
    platform_blank = ("url",)
    platform_redacted = ("last_error",)
    deployment: serializers.SlugRelatedField[Deployment] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    region = RegionKeyField(read_only=True)
    public_id = serializers.CharField(read_only=True)

    class Meta:
        model = Replica
        fields = [
            "id", "public_id", "deployment", "region", "offer", "provider", "url", "state",
            "spot", "last_error", "created_at", "state_changed_at", "ready_at", "terminated_at",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "url": {"help_text": "The engine's address: platform staff only (empty for tenant "
                                 "users, who reach replicas through the edges)."},
            "last_error": {"help_text": "Addresses in it are hidden from tenant users."},
        }


class AuditLogSerializer(_PlatformDetail):
    platform_redacted = ("reason",)

    class Meta:
        model = AuditLog
        fields = [
            "id", "at", "actor", "action", "object_type", "object_id", "object_repr",
            "tenant", "changes", "reason",
        ]
        read_only_fields = fields


class _Check(serializers.Serializer):
    ok = serializers.BooleanField()
    detail = serializers.CharField()


class _ProcessHeartbeat(serializers.Serializer):
    kind = serializers.ChoiceField(choices=["worker", "beat"])
    name = serializers.CharField()
    hostname = serializers.CharField()
    pid = serializers.IntegerField()
    queues = serializers.ListField(child=serializers.CharField())
    at = serializers.FloatField(help_text="Unix time of its last heartbeat")
    age_s = serializers.FloatField()
    ok = serializers.BooleanField(help_text="fresh: within stale_after_s")


class StatusSerializer(serializers.Serializer):
    ok = serializers.BooleanField()
    database = _Check()
    redis = _Check()
    celery = _Check()
    beat = _Check()
    workers = serializers.ListField(child=serializers.CharField(),
                                    help_text="workers whose heartbeat is fresh")
    heartbeats = _ProcessHeartbeat(many=True)
    stale_after_s = serializers.FloatField()
    last_beat_tick = serializers.DateTimeField(
        allow_null=True, help_text="when a worker last ran beat's core.beat_tick")


class EdgeSerializer(_PlatformDetail):
    platform_blank = ("admin_url", "last_error")

    region = RegionKeyField()
    latest_version = serializers.IntegerField(read_only=True, allow_null=True)
    in_sync = serializers.SerializerMethodField()

    class Meta:
        model = Edge
        fields = [
            "id", "name", "region", "admin_url", "public_url", "enabled", "last_acked_version",
            "last_acked_at", "last_seen_at", "last_error", "latest_version", "in_sync",
            "created_at",
        ]
        read_only_fields = [
            "last_acked_version", "last_acked_at", "last_seen_at", "last_error", "created_at",
        ]
        extra_kwargs = {
            "admin_url": {"help_text": "Where the control plane pushes tables: platform staff "
                                       "only (empty for tenant users)."},
            "last_error": {"help_text": "The last push's error: platform staff only (empty for "
                                        "tenant users)."},
        }

    @extend_schema_field(serializers.BooleanField())
    def get_in_sync(self, obj: Edge) -> bool:
        latest = getattr(obj, "latest_version", None)
        return latest is None or obj.last_acked_version == latest


class RoutingPolicySerializer(StrictModelSerializer):
    class Meta:
        model = RoutingPolicy
        fields = [
            "id", "name", "scorers", "retry_before_first_byte", "eject_after_failures",
            "eject_base_s", "resume_streams_max", "resume_deadline_s", "stream_stall_s",
            "first_byte_timeout_s", "aliases", "max_table_age_s", "stale_table_mode",
            "fail_open_tenants", "updated_at",
        ]
        read_only_fields = ["updated_at"]

    fail_open_tenants = serializers.SlugRelatedField(
        slug_field="name", queryset=Tenant.objects.all(), many=True, required=False,
        help_text="Tenants an edge still serves from a stale table when stale_table_mode is "
                  "fail_closed.")

    def validate_scorers(self, value: Any) -> dict[str, float]:
        known = {"latency", "load", "prefix", "cost"}
        if not isinstance(value, dict) or not value:
            raise serializers.ValidationError('Expected weights by scorer, e.g. {"load": 2.0}.')
        unknown = sorted(set(value) - known)
        if unknown:
            raise serializers.ValidationError(
                f"Unknown scorer(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}."
            )
        for name, weight in value.items():
            if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight < 0:
                raise serializers.ValidationError(f"Weight of {name} must be a number ≥ 0.")
        return {name: float(weight) for name, weight in value.items()}

    def validate_aliases(self, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise serializers.ValidationError("Expected an object of alias → rule.")
        # The edge's own rules, then the served names: a table with both would be refused.
        problem = routing_names.alias_problems(value)
        if problem:
            raise serializers.ValidationError(problem)
        return value


class OperationSerializer(_PlatformDetail):
    replica = serializers.SerializerMethodField()
    log = serializers.SerializerMethodField(
        help_text="The provider's log for platform staff; tenant users get a one-line summary "
                  "(what it was and how it went), never a traceback.")

    class Meta:
        model = Operation
        fields = ["id", "kind", "provider", "replica", "status", "error_kind", "log", "attempts",
                  "created_at", "started_at", "finished_at"]
        read_only_fields = fields

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_replica(self, obj: Operation) -> str | None:
        return f"r-{obj.replica_id}" if obj.replica_id else None

    @extend_schema_field(serializers.CharField())
    def get_log(self, obj: Operation) -> str:
        if self.for_platform():
            return obj.log
        return operation_summary(obj.kind, obj.status, obj.error_kind, obj.attempts)
