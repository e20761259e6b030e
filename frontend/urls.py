"""Routes of the dashboard; the project mounts them at the site root."""

from django.contrib.auth import views as auth_views
from django.urls import path

from frontend.views import (
    alerts,
    assets,
    batches,
    costs,
    deployments,
    events,
    failover,
    inventory,
    overview,
    plans,
    rollouts,
    routing,
    tenants,
)

app_name = "frontend"

urlpatterns = [
    path("", overview.overview, name="overview"),
    path("live/overview/", overview.overview_live, name="overview-live"),
    path("login/", auth_views.LoginView.as_view(
        template_name="frontend/login.html", redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(next_page="frontend:login"), name="logout"),
    path("inventory/", inventory.inventory, name="inventory"),
    path("deployments/", deployments.deployment_list, name="deployments"),
    path("deployments/<slug:name>/", deployments.deployment_detail, name="deployment"),
    path("deployments/<slug:name>/replicas/", deployments.replica_table,
         name="deployment-replicas"),
    path("deployments/<slug:name>/scale/", deployments.scale, name="deployment-scale"),
    path("replicas/<int:pk>/drain/", deployments.drain, name="replica-drain"),
    path("plans/", plans.plan_list, name="plans"),
    path("plans/propose/", plans.propose, name="plan-propose"),
    path("plans/<int:pk>/", plans.plan_detail, name="plan"),
    path("plans/<int:pk>/<str:step>/", plans.review, name="plan-review"),
    path("rollouts/", rollouts.rollout_list, name="rollouts"),
    path("rollouts/start/", rollouts.start, name="rollout-start"),
    path("rollouts/<int:pk>/", rollouts.rollout_detail, name="rollout"),
    path("rollouts/<int:pk>/<str:action>/", rollouts.act, name="rollout-act"),
    path("routing/", routing.routing, name="routing"),
    path("routing/edges/", routing.edge_table, name="routing-edges"),
    path("routing/<slug:edge>/diff/", routing.table_diff, name="routing-diff"),
    path("costs/", costs.costs, name="costs"),
    path("failover/", failover.failover, name="failover"),
    path("failover/drill/", failover.drill, name="failover-drill"),
    path("failover/live/", failover.failover_live, name="failover-live"),
    path("batches/", batches.batch_list, name="batches"),
    path("batches/live/", batches.batch_table, name="batches-live"),
    path("batches/<str:batch_id>/", batches.batch_detail, name="batch"),
    path("batches/<str:batch_id>/live/", batches.batch_summary, name="batch-summary"),
    path("batches/<str:batch_id>/cancel/", batches.cancel, name="batch-cancel"),
    path("events/", events.events, name="events"),
    path("alerts/", alerts.alerts, name="alerts"),
    path("alerts/<int:pk>/acknowledge/", alerts.acknowledge, name="alert-acknowledge"),
    path("tenants/", tenants.tenant_list, name="tenants"),
    path("tenants/<slug:name>/", tenants.tenant_detail, name="tenant"),
    path("tenants/<slug:name>/keys/", tenants.create_key, name="tenant-key-create"),
    path("keys/<int:pk>/revoke/", tenants.revoke_key, name="key-revoke"),
    path(f"assets/plotly-{assets.plotly_version()}.min.js", assets.plotly_js,
         {"version": assets.plotly_version()}, name="plotly"),
]
