"""Routes of the REST API under /api/v1/."""

from django.urls import path
from rest_framework.routers import DefaultRouter

from controlplane.api import (
    batch_views,
    cost_views,
    failover_views,
    gpu_views,
    plan_views,
    routing_views,
    views,
)
from controlplane.api.alert_views import AlertRulesView, AlertViewSet
from controlplane.api.batch_operator_views import BatchViewSet
from controlplane.api.rollout_views import RolloutViewSet
from controlplane.api.scaling_views import ScalingDecisionViewSet

router = DefaultRouter()
router.register("clouds", views.CloudViewSet)
router.register("jurisdictions", views.JurisdictionViewSet)
router.register("regions", views.RegionViewSet)
router.register("gpu-types", views.GpuTypeViewSet)
router.register("offers", views.OfferViewSet)
router.register("quotas", views.QuotaViewSet)
router.register("tenants", views.TenantViewSet)
router.register("api-keys", views.ApiKeyViewSet)
router.register("models", views.LlmModelViewSet)
router.register("deployments", views.DeploymentViewSet)
router.register("replicas", views.ReplicaViewSet)
router.register("audit-log", views.AuditLogViewSet)
router.register("edges", routing_views.EdgeViewSet)
router.register("routing-policy", routing_views.RoutingPolicyViewSet)
router.register("plans", plan_views.PlanViewSet)
router.register("alerts", AlertViewSet)
router.register("operations", views.OperationViewSet)
router.register("gpu-nodes", gpu_views.GpuNodeViewSet)
router.register("cost-rollups", cost_views.CostRollupViewSet)
router.register("budgets", cost_views.BudgetViewSet, basename="budgets")
router.register("incidents", failover_views.IncidentViewSet)
router.register("region-health", failover_views.RegionHealthViewSet)
router.register("scaling-decisions", ScalingDecisionViewSet)
router.register("rollouts", RolloutViewSet)
router.register("batches", BatchViewSet)

urlpatterns = [
    path("status/", views.StatusView.as_view(), name="status"),
    path("costs/", cost_views.CostSummaryView.as_view(), name="costs"),
    path("alert-rules/", AlertRulesView.as_view(), name="alert-rules"),
    path("gpu-reports/", gpu_views.GpuReportView.as_view(), name="gpu-reports"),
    path("edges/<slug:name>/table", routing_views.EdgeTableView.as_view(), name="edge-table"),
    *router.urls,
]

# OpenAI's Files and Batches, served at /v1/ (controlplane/urls.py) with inference keys.
openai_urlpatterns = [
    path("files", batch_views.files, name="openai-files"),
    path("files/<str:file_id>", batch_views.file_detail, name="openai-file"),
    path("files/<str:file_id>/content", batch_views.file_content, name="openai-file-content"),
    path("batches", batch_views.batches, name="openai-batches"),
    path("batches/<str:batch_id>", batch_views.batch_detail, name="openai-batch"),
    path("batches/<str:batch_id>/cancel", batch_views.batch_cancel, name="openai-batch-cancel"),
]
