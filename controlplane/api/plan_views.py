"""API for placement plans: propose, read with reasons, approve, apply, reject."""

from __future__ import annotations

from typing import Any

from django.db.models import Prefetch
from django.urls import reverse
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api.base import TenantScopedViewSet
from controlplane.api.fields import DeploymentRefField, RegionKeyField
from controlplane.api.strict_input import StrictSerializer
from controlplane.core.models import Role
from controlplane.core.services import principal_for
from controlplane.deployments.models import Deployment
from controlplane.placement.models import Plan, PlanChange
from controlplane.placement.proposals import propose_plan
from controlplane.plans import apply as plans
from regions.models import Offer


class PlanChangeSerializer(serializers.ModelSerializer):
    deployment: serializers.SlugRelatedField[Deployment] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    region = RegionKeyField(read_only=True)
    offer: serializers.StringRelatedField[Offer] = serializers.StringRelatedField()

    class Meta:
        model = PlanChange
        fields = ["id", "deployment", "action", "region", "offer", "count", "spot",
                  "usd_h_delta", "reason", "replica_ids"]
        read_only_fields = fields


class PlanSerializer(serializers.ModelSerializer):
    changes = PlanChangeSerializer(many=True, read_only=True)
    cost_after_usd_h = serializers.DecimalField(
        max_digits=14, decimal_places=4, read_only=True, allow_null=True,
        help_text="Null when there is no plan (status infeasible).")
    saving_usd_h = serializers.FloatField(
        read_only=True, allow_null=True,
        help_text="Before less after (negative: what the plan adds); null without a plan.")
    nothing_to_do = serializers.SerializerMethodField(
        help_text="A plan that changes nothing: it cannot be approved or applied.")
    unplaced = serializers.ListField(
        child=serializers.DictField(child=serializers.CharField()), read_only=True,
        help_text="Deployments the plan could not place, each with why; the plan covers "
                  "the others.")

    class Meta:
        model = Plan
        fields = ["id", "status", "trigger", "scope", "explanation", "cost_before_usd_h",
                  "cost_after_usd_h", "saving_usd_h", "nothing_to_do", "unplaced", "solver",
                  "proposed_by", "created_at", "reviewed_by", "reviewed_at", "applied_at",
                  "superseded_by", "basis", "basis_fingerprint", "changes", "inputs", "log"]
        read_only_fields = fields

    def get_nothing_to_do(self, plan: Plan) -> bool:
        return plan.has_plan and not plan.changes.all()


class PlanRefusal(serializers.Serializer):
    detail = serializers.CharField()
    changed = serializers.ListField(
        child=serializers.CharField(), required=False,
        help_text="What moved in the fleet since the plan was computed, one line each.")
    superseded_by = serializers.IntegerField(required=False, allow_null=True,
                                             help_text="The newer plan that replaced it.")
    propose_url = serializers.CharField(
        required=False, help_text="POST here (with `propose`) to plan the fleet as it is now.")
    propose = serializers.DictField(required=False)


class ProposeRequest(StrictSerializer):
    deployments = DeploymentRefField(
        queryset=Deployment.objects.all(), many=True, required=False,
        help_text="Deployments to plan, by name (or id); omit for all.",
    )


class ReviewRequest(StrictSerializer):
    reason = serializers.CharField(max_length=500, required=False, default="",
                                   help_text="Why, for the audit log.")


class PlanViewSet(TenantScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                  viewsets.GenericViewSet):
    """Plans are platform-wide, for platform staff alone (they name every tenant's
    deployments, regions and costs): every platform role reads them; operators propose and
    review. Tenant users get 403."""

    write_role = Role.OPERATOR
    platform_only = True
    platform_only_writes = True
    queryset = Plan.objects.prefetch_related(
        Prefetch("changes", PlanChange.objects.select_related(
            "deployment", "region__cloud", "offer__region__cloud", "offer__gpu_type"))
    )
    serializer_class = PlanSerializer
    filterset_fields = ["status", "trigger"]
    ordering_fields = ["created_at"]

    def _actor(self, request: Request) -> str:
        return principal_for(request.user).username

    @extend_schema(request=ProposeRequest, responses={201: PlanSerializer})
    @action(detail=False, methods=["post"])
    def propose(self, request: Request) -> Response:
        """Run the solver over some or all deployments and store the result as a plan."""
        body = ProposeRequest(data=request.data)
        body.is_valid(raise_exception=True)
        plan = propose_plan(body.validated_data.get("deployments"), actor=self._actor(request),
                            trigger="manual")
        return Response(PlanSerializer(self.get_queryset().get(pk=plan.pk)).data,
                        status=status.HTTP_201_CREATED)

    def _review(self, request: Request, step: Any) -> Response:
        body = ReviewRequest(data=request.data)
        body.is_valid(raise_exception=True)
        plan = self.get_object()
        try:
            step(plan.pk, self._actor(request), reason=body.validated_data["reason"])
        except plans.PlanStateError as exc:
            return Response(_refusal(plan, exc), status=status.HTTP_409_CONFLICT)
        return Response(PlanSerializer(self.get_queryset().get(pk=plan.pk)).data)

    @extend_schema(request=ReviewRequest, responses={200: PlanSerializer, 409: PlanRefusal})
    @action(detail=True, methods=["post"])
    def approve(self, request: Request, pk: Any = None) -> Response:
        return self._review(request, plans.approve)

    @extend_schema(request=ReviewRequest, responses={200: PlanSerializer, 409: PlanRefusal})
    @action(detail=True, methods=["post"])
    def apply(self, request: Request, pk: Any = None) -> Response:
        """Start make-before-break: new replicas first, removals once they are ready."""
        return self._review(request, plans.start_apply)

    @extend_schema(request=ReviewRequest, responses=PlanSerializer)
    @action(detail=True, methods=["post"])
    def reject(self, request: Request, pk: Any = None) -> Response:
        return self._review(request, plans.reject)


def _refusal(plan: Plan, exc: plans.PlanStateError) -> dict[str, Any]:
    """A 409's body: why, and for a stale plan what moved and how to propose again."""
    body: dict[str, Any] = {"detail": str(exc)}
    if isinstance(exc, plans.PlanSupersededError):
        body["superseded_by"] = exc.by
    if isinstance(exc, plans.PlanStaleError):
        body["changed"] = exc.changed
        body["propose_url"] = reverse("plan-propose")
        body["propose"] = {"deployments": list(plan.scope)}
    return body
