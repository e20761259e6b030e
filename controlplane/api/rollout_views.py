"""API for progressive rollouts: start one with a new revision's settings, then pause,
resume, advance a step, promote or roll back. Every action is an audit event; an action the
rollout's state does not allow answers 409 saying why."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api.base import TenantScopedViewSet
from controlplane.api.fields import DeploymentRefField
from controlplane.api.strict_input import StrictSerializer
from controlplane.core.models import Role
from controlplane.core.services import principal_for
from controlplane.deployments.models import Deployment, Model, Revision
from controlplane.rollouts import lifecycle, validation
from controlplane.rollouts.models import Rollout, RolloutStep
from regions.models import GpuType


class RevisionSerializer(serializers.ModelSerializer):
    model: serializers.SlugRelatedField[Model] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)
    preferred_gpu_type: serializers.SlugRelatedField[GpuType] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)

    class Meta:
        model = Revision
        fields = ["id", "number", "model", "vllm_version", "engine_args", "tensor_parallel",
                  "pipeline_parallel", "preferred_gpu_type", "created_at"]
        read_only_fields = fields


class RolloutStepSerializer(serializers.ModelSerializer):
    class Meta:
        model = RolloutStep
        fields = ["wave", "step", "weight", "started_at", "ready_at", "ended_at", "extensions",
                  "analysis", "decision"]
        read_only_fields = fields


class RolloutSerializer(serializers.ModelSerializer):
    deployment = DeploymentRefField(read_only=True)
    from_revision = RevisionSerializer(read_only=True)
    to_revision = RevisionSerializer(read_only=True)
    weight = serializers.IntegerField(read_only=True,
                                      help_text="The canary revision's share now (%).")
    step_rows = RolloutStepSerializer(many=True, read_only=True)

    class Meta:
        model = Rollout
        fields = ["id", "deployment", "strategy", "state", "steps", "bake_s",
                  "rollback_window_s", "auto_promote", "waves", "current_wave", "thresholds",
                  "current_step", "weight", "from_revision", "to_revision", "start_reason", "reason",
                  "created_by", "ended_by", "created_at", "started_at", "ended_at",
                  "replicas_wanted", "old_retired_at", "step_rows"]
        read_only_fields = fields


class StartRequest(StrictSerializer):
    deployment = DeploymentRefField(queryset=Deployment.objects.all())
    strategy = serializers.JSONField(required=False, help_text=(
        "canary (default): the new revision on a growing share, step by step; blue_green: "
        "as many new replicas as the stable ones, all traffic switched once they serve, the "
        "old set kept for rollback_window_s, then retired."))
    steps = serializers.JSONField(required=False, help_text="Canary weights (%), increasing, "
                                  "ending at 100. Default [5, 25, 50, 100]; blue_green: [100].")
    waves = serializers.JSONField(required=False, help_text=(
        "canary only: lists of edge regions (cloud:code), e.g. [[\"aws:eu-central-1\"], "
        "[\"aws:us-east-1\", \"gcp:europe-west4\"]]; each wave's edges go through every "
        "step in turn while earlier waves' stay at 100% and later ones' at 0%. Default: "
        "every edge at once."))
    rollback_window_s = serializers.JSONField(required=False, help_text=(
        "blue_green only: seconds the old set is kept after the switch, the new one judged "
        "all the while (0 < s ≤ 86400, default 600)."))
    auto_promote = serializers.JSONField(required=False, help_text=(
        "canary: true (default) promotes once the last step's analysis passes; false holds "
        "the last step for an operator's promote."))
    bake_s = serializers.JSONField(required=False, help_text="Seconds each step is held "
                                   "(> 0). Default 300.")
    model = serializers.SlugRelatedField(slug_field="name", queryset=Model.objects.all(),
                                         required=False)
    vllm_version = serializers.CharField(max_length=32, required=False, allow_blank=True)
    engine_args = serializers.DictField(required=False)
    tensor_parallel = serializers.IntegerField(min_value=1, max_value=16, required=False)
    pipeline_parallel = serializers.IntegerField(min_value=1, max_value=16, required=False)
    preferred_gpu_type = serializers.SlugRelatedField(
        slug_field="name", queryset=GpuType.objects.all(), required=False)
    thresholds = serializers.JSONField(required=False, help_text=(
        "What each step is judged by; any left out take their defaults: ttft_ratio 1.2, "
        "itl_ratio 1.2 (canary p95 ≤ ratio × stable), error_points 1.0 (canary 5xx rate ≤ "
        "stable + points), max_ttft_p95_s (the deployment's TTFT SLO), max_error_rate 0.05, "
        "min_requests 20 (per side, else the step is extended), max_extensions 3 (then the "
        "rollout is held)."))
    reason = serializers.CharField(
        max_length=500, required=False, default="", allow_blank=True,
        help_text="Why it is started: kept as the rollout's start_reason (its reason says why "
                  "it ended).")

    RAW = ("strategy", "steps", "waves", "rollback_window_s", "auto_promote", "bake_s",
           "thresholds")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """The rollout asked for, checked and typed (`validation.rollout_request`); its
        errors answer 400 naming the field, as the fields' own do."""
        revision = validation.RevisionSpec(
            model=attrs.get("model"), vllm_version=attrs.get("vllm_version"),
            engine_args=attrs.get("engine_args") or {},
            tensor_parallel=attrs.get("tensor_parallel"),
            pipeline_parallel=attrs.get("pipeline_parallel"),
            preferred_gpu_type=attrs.get("preferred_gpu_type"))
        raw = {name: attrs[name] for name in self.RAW if name in attrs}
        try:
            wanted = validation.rollout_request(attrs["deployment"], raw, revision,
                                                reason=attrs["reason"])
        except validation.RolloutInputError as exc:
            raise serializers.ValidationError({exc.field: [str(exc)]}) from None
        return {"deployment": attrs["deployment"], "request": wanted}


class ActionRequest(StrictSerializer):
    reason = serializers.CharField(max_length=500, required=False, default="")


class RolloutViewSet(TenantScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                     viewsets.GenericViewSet):
    """Every role reads rollouts; platform operators start and steer them."""

    write_role = Role.OPERATOR
    platform_only_writes = True
    queryset = Rollout.objects.select_related(
        "deployment", "from_revision__model", "to_revision__model",
        "from_revision__preferred_gpu_type", "to_revision__preferred_gpu_type",
    ).prefetch_related("step_rows")
    serializer_class = RolloutSerializer
    filterset_fields = ["state"]
    ordering_fields = ["created_at", "started_at", "ended_at", "state"]

    def _actor(self, request: Request) -> str:
        return principal_for(request.user).username

    def _answer(self, rollout_id: int, code: int = status.HTTP_200_OK) -> Response:
        return Response(RolloutSerializer(self.get_queryset().get(pk=rollout_id)).data,
                        status=code)

    @extend_schema(request=StartRequest, responses={201: RolloutSerializer})
    def create(self, request: Request) -> Response:
        """A new revision of the deployment (settings not given: the stable revision's) and a
        canary rollout of it at its first step."""
        body = StartRequest(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            rollout = lifecycle.start(body.validated_data["deployment"],
                                      body.validated_data["request"], actor=self._actor(request))
        except lifecycle.RolloutStateError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return self._answer(rollout.pk, status.HTTP_201_CREATED)

    def _act(self, request: Request, step: Callable[..., Rollout]) -> Response:
        body = ActionRequest(data=request.data)
        body.is_valid(raise_exception=True)
        rollout = self.get_object()
        try:
            step(rollout.pk, actor=self._actor(request), reason=body.validated_data["reason"])
        except lifecycle.RolloutStateError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return self._answer(rollout.pk)

    @extend_schema(request=ActionRequest, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def pause(self, request: Request, pk: Any = None) -> Response:
        """Hold the current step (the canary keeps its weight)."""
        return self._act(request, lifecycle.pause)

    @extend_schema(request=ActionRequest, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, pk: Any = None) -> Response:
        return self._act(request, lifecycle.resume)

    @extend_schema(request=ActionRequest, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def advance(self, request: Request, pk: Any = None) -> Response:
        """The next step's weight."""
        return self._act(request, lifecycle.advance)

    @extend_schema(request=ActionRequest, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def promote(self, request: Request, pk: Any = None) -> Response:
        """The new revision becomes the deployment's stable one."""
        return self._act(request, lifecycle.promote)

    @extend_schema(request=ActionRequest, responses=RolloutSerializer)
    @action(detail=True, methods=["post"])
    def rollback(self, request: Request, pk: Any = None) -> Response:
        """Canary weight 0 at once; its replicas drained."""
        return self._act(request, lifecycle.roll_back)
