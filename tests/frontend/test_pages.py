"""Dashboard pages through Django's test client: sign-in, roles, tenancy, actions and audit."""

from __future__ import annotations

import gzip
import re
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse

from controlplane.core.hashing import sha256_hex
from controlplane.core.models import ApiKey, AuditLog, Role
from controlplane.deployments.lifecycle import LIVE_STATES
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.placement.models import Plan, PlanStatus
from frontend.fleet import BILLED_STATES
from frontend.views.common import NAV
from tests.frontend.fleet import Fleet, seed_fleet

pytestmark = pytest.mark.django_db


def page_urls(fleet: Fleet) -> list[str]:
    """Every page of the dashboard, with a real object where a page shows one."""
    return [
        reverse("frontend:overview"),
        reverse("frontend:inventory"),
        reverse("frontend:inventory") + "?tab=regions",
        reverse("frontend:deployments"),
        reverse("frontend:deployment", args=[fleet.acme.name]),
        reverse("frontend:plans"),
        reverse("frontend:plan", args=[fleet.plan.pk]),
        reverse("frontend:routing"),
        reverse("frontend:events"),
        reverse("frontend:failover"),
        reverse("frontend:alerts"),
        reverse("frontend:costs"),
        reverse("frontend:tenants"),
        reverse("frontend:tenant", args=["acme"]),
    ]


def fragment_urls(fleet: Fleet) -> list[str]:
    return [
        reverse("frontend:overview-live") + "?part=figures",
        reverse("frontend:overview-live") + "?part=attention",
        reverse("frontend:deployment-replicas", args=[fleet.acme.name]),
        reverse("frontend:routing-edges"),
    ]


def first(fleet: Fleet, deployment: Any, state: str) -> Replica:
    return next(r for r in fleet.replicas if r.deployment_id == deployment.pk and r.state == state)


def test_visitors_who_are_not_signed_in_are_sent_to_sign_in(client, fleet):  # type: ignore[no-untyped-def]
    for url in page_urls(fleet) + fragment_urls(fleet):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/login/?next="), url


def test_signing_in_lands_on_the_overview(client, make_user):  # type: ignore[no-untyped-def]
    make_user(Role.VIEWER, username="vic")
    wrong = client.post("/login/", {"username": "vic", "password": "nope"})
    assert wrong.status_code == 200 and b"Please enter a correct username" in wrong.content
    response = client.post("/login/", {"username": "vic", "password": "pw-vic"})
    assert response.status_code == 302 and response["Location"] == "/"
    assert client.get("/").status_code == 200
    client.post("/logout/")
    assert client.get("/").status_code == 302


def test_a_user_without_a_role_is_told_to_ask_for_one(client, fleet):  # type: ignore[no-untyped-def]
    client.force_login(get_user_model().objects.create_user("nobody", password="x"))
    response = client.get("/")
    assert response.status_code == 403
    assert b"no role; ask an admin" in response.content


def test_every_page_renders_with_one_nav_that_links_every_page(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.VIEWER)
    targets = {reverse(f"frontend:{name}") for name, _, _ in NAV}
    for url in page_urls(fleet):
        response = client.get(url)
        assert response.status_code == 200, url
        html = response.content.decode()
        assert html.count("<nav class=\"mainnav\"") == 1, url
        nav = html.split('<nav class="mainnav"', 1)[1].split("</nav>", 1)[0]
        assert set(re.findall(r'href="([^"]+)"', nav)) == targets, url
    for url in fragment_urls(fleet):
        assert client.get(url).status_code == 200, url


def test_no_page_loads_anything_from_another_site(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.ADMIN)
    for url in page_urls(fleet):
        html = client.get(url).content.decode()
        sources = re.findall(r'<(?:script|link)[^>]+(?:src|href)="([^"]+)"', html)
        assert sources and all(s.startswith("/") for s in sources), (url, sources)


def test_plotly_and_the_world_map_are_served_from_this_site(client, signed_in):  # type: ignore[no-untyped-def]
    response = client.get(reverse("frontend:plotly"), HTTP_ACCEPT_ENCODING="gzip")
    assert response.status_code == 200 and response["Content-Encoding"] == "gzip"
    assert gzip.decompress(response.content).startswith(b"/**\n* plotly.js v")
    assert "immutable" in response["Cache-Control"]
    plain = client.get(reverse("frontend:plotly"))
    assert plain.content.startswith(b"/**\n* plotly.js v") and "Content-Encoding" not in plain
    html = signed_in(Role.VIEWER).get("/").content.decode()
    folder = re.search(r'data-topojson-url="([^"]+)"', html).group(1)  # type: ignore[union-attr]
    topojson = client.get(folder + "world_110m.json")
    assert topojson.status_code == 200
    assert b'"type":"Topology"' in b"".join(topojson.streaming_content).replace(b" ", b"")


def _usd_h(replica: Replica) -> Decimal:
    offer = replica.offer
    assert offer is not None
    if replica.spot and offer.spot_usd_h is not None:
        return offer.spot_usd_h
    return offer.on_demand_usd_h


def test_overview_figures_come_from_the_fleet(signed_in, fleet):  # type: ignore[no-untyped-def]
    response = signed_in(Role.VIEWER).get("/")
    overview = response.context["fleet"]
    assert overview.replicas_live == sum(1 for r in fleet.replicas if r.state in LIVE_STATES)
    assert overview.usd_h == sum(_usd_h(r) for r in fleet.replicas if r.state in BILLED_STATES)
    assert overview.states["failed"] == sum(1 for r in fleet.replicas if r.state == S.FAILED)
    assert (overview.edges_in_sync, overview.edges_enabled) == (1, 2)
    # Three replicas sampled 45 s and 5 s ago, 100 requests apart: 2.5/s each.
    assert response.context["now"].rates.requests_per_s == pytest.approx(7.5)
    html = response.content.decode()
    assert "Error rate" in html and "no data yet" in html
    assert 'id="world-map"' in html and "world-map-data" in html


def test_a_replica_costs_its_offer_price_times_the_nodes_it_spans(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.VIEWER)
    single = {d.name: d.usd_h for d in client.get("/deployments/").context["page"]}
    # PP 6 on one-GPU machines: six nodes per replica.
    fleet.acme.tensor_parallel, fleet.acme.pipeline_parallel = 1, 6
    fleet.acme.save()
    spread = {d.name: d.usd_h for d in client.get("/deployments/").context["page"]}
    assert spread["chat-acme"] == 6 * single["chat-acme"]
    assert spread["chat-shared"] == single["chat-shared"]
    # A tensor-parallel group never spans machines: TP 2 on one-GPU machines cannot run,
    # and what cannot run is billed nothing (deployments.shape.replica_nodes).
    fleet.acme.tensor_parallel, fleet.acme.pipeline_parallel = 2, 3
    fleet.acme.save()
    impossible = {d.name: d.usd_h for d in client.get("/deployments/").context["page"]}
    assert not impossible["chat-acme"]


def test_tenant_users_see_their_own_rows_and_shared_ones_only(signed_in, fleet, tenants):  # type: ignore[no-untyped-def]
    client = signed_in(Role.VIEWER, tenants["acme"])
    listed = [d.name for d in client.get("/deployments/").context["page"]]
    assert listed == ["chat-acme", "chat-shared"]
    assert client.get(f"/deployments/{fleet.globex.name}/").status_code == 404
    overview = client.get("/").context["fleet"]
    visible = [r for r in fleet.replicas if r.deployment_id != fleet.globex.pk]
    assert overview.replicas_live == sum(1 for r in visible if r.state in LIVE_STATES)
    events = client.get("/events/").context["page"]
    assert events and {e.tenant_id for e in events} == {tenants["acme"].pk}
    assert [t.name for t in client.get("/tenants/").context["page"]] == ["acme"]
    assert client.get("/tenants/globex/").status_code == 404
    assert client.get(f"/routing/{fleet.edges[0].name}/diff/").status_code == 403


def test_viewer_sees_no_action_buttons_where_an_operator_does(signed_in, fleet):  # type: ignore[no-untyped-def]
    detail = f"/deployments/{fleet.acme.name}/"
    pages = {detail: ["/drain/", "Scale in a region"],
             f"/plans/{fleet.plan.pk}/": ["/approve/", "/reject/"],
             "/plans/": ["Propose a plan"],
             "/tenants/acme/": ["Create a key", "/revoke/"],
             "/failover/": ["Start a drill"]}
    viewer = signed_in(Role.VIEWER)
    for url, markers in pages.items():
        html = viewer.get(url).content.decode()
        assert not [m for m in markers if m in html], url
    admin = signed_in(Role.ADMIN)
    for url, markers in pages.items():
        html = admin.get(url).content.decode()
        assert all(m in html for m in markers), url


def _forged_posts(fleet: Fleet) -> dict[str, dict[str, str]]:
    ready = first(fleet, fleet.acme, S.READY)
    key = ApiKey.objects.get(tenant__name="acme")
    return {
        f"/replicas/{ready.pk}/drain/": {"reason": "forged"},
        f"/deployments/{fleet.acme.name}/scale/": {
            "region": "aws:eu-central-1", "replicas": "0", "confirm": "yes"},
        f"/plans/{fleet.plan.pk}/approve/": {},
        f"/plans/{fleet.plan.pk}/reject/": {},
        "/plans/propose/": {},
        "/tenants/acme/keys/": {"name": "forged", "tier": "interactive"},
        f"/keys/{key.pk}/revoke/": {},
        "/failover/drill/": {"region": "aws:eu-central-1", "confirm": "yes"},
    }


def test_viewer_forging_any_action_gets_403_and_nothing_changes(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.VIEWER)
    states = {r.pk: r.state for r in Replica.objects.all()}
    for url, form in _forged_posts(fleet).items():
        response = client.post(url, form)
        assert response.status_code == 403, url
        assert b"needs the" in response.content, url
    assert {r.pk: r.state for r in Replica.objects.all()} == states
    assert Plan.objects.get(pk=fleet.plan.pk).status == PlanStatus.PROPOSED
    assert not ApiKey.objects.filter(name="forged").exists()
    assert ApiKey.objects.get(tenant__name="acme").revoked_at is None
    assert not AuditLog.objects.filter(actor="viewer-platform").exists()


def test_operator_cannot_manage_keys(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.OPERATOR)
    response = client.post("/tenants/acme/keys/", {"name": "k", "tier": "interactive"})
    assert response.status_code == 403 and b"needs the admin role" in response.content


def test_pages_answer_only_their_methods(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.ADMIN)
    assert client.post("/").status_code == 405
    assert client.get(f"/deployments/{fleet.acme.name}/scale/").status_code == 405


def test_operator_scales_after_reviewing_what_will_change(  # type: ignore[no-untyped-def]
    signed_in, fleet, catalog, sent_tasks, django_capture_on_commit_callbacks,
):
    client = signed_in(Role.OPERATOR)
    url = f"/deployments/{fleet.acme.name}/scale/"
    here = Replica.objects.filter(deployment=fleet.acme, region=catalog["ams"])
    live = here.filter(state__in=LIVE_STATES).exclude(state=S.DRAINING).count()
    total = here.count()
    form = {"region": "gcp:europe-west4", "replicas": str(live + 2), "reason": "demand"}
    preview = client.post(url, form)
    assert preview.status_code == 200 and b"Nothing has changed yet" in preview.content
    assert preview.context["result"].to_add == 2 and here.count() == total
    with django_capture_on_commit_callbacks(execute=True):
        done = client.post(url, {**form, "confirm": "yes"})
    assert done.status_code == 302 and done["Location"] == f"/deployments/{fleet.acme.name}/"
    new = list(here.filter(state=S.PENDING).order_by("-pk")[:2])
    assert here.count() == total + 2
    requested = AuditLog.objects.filter(action="replica.requested", actor="operator-platform",
                                        reason="demand")
    assert sorted(requested.values_list("object_id", flat=True)) == sorted(str(r.pk) for r in new)
    assert sorted(args[0] for name, args, _ in sent_tasks
                  if name == "provisioning.provision_replica") == sorted(r.pk for r in new)


def test_scaling_down_drains_the_extra_replicas_after_the_review(  # type: ignore[no-untyped-def]
    signed_in, fleet, sent_tasks, django_capture_on_commit_callbacks,
):
    client = signed_in(Role.OPERATOR)
    ready = first(fleet, fleet.acme, S.READY)
    url = f"/deployments/{fleet.acme.name}/scale/"
    form = {"region": ready.region.key, "replicas": "0"}
    active = list(Replica.objects.filter(deployment=fleet.acme, region=ready.region,
                                         state__in=LIVE_STATES).exclude(state=S.DRAINING))
    preview = client.post(url, form)
    assert sorted(preview.context["result"].draining) == sorted(r.public_id for r in active)
    assert Replica.objects.get(pk=ready.pk).state == S.READY
    with django_capture_on_commit_callbacks(execute=True):
        client.post(url, {**form, "confirm": "yes"})
    # Serving replicas drain first; the others are simply terminated after the deadline.
    assert Replica.objects.get(pk=ready.pk).state == S.DRAINING
    terminating = {args[0] for name, args, options in sent_tasks
                   if name == "provisioning.terminate_replica" and options == {"countdown": 30}}
    assert terminating == {r.pk for r in active}


def test_scale_beyond_max_replicas_is_refused_with_the_limit(signed_in, fleet, catalog):  # type: ignore[no-untyped-def]
    fleet.acme.max_replicas = 1
    fleet.acme.save()
    response = signed_in(Role.OPERATOR).post(
        f"/deployments/{fleet.acme.name}/scale/",
        {"region": "gcp:europe-west4", "replicas": "5", "confirm": "yes"})
    assert response.status_code == 400
    assert b"would exceed max_replicas (1)" in response.content


def test_regions_outside_the_deployments_jurisdictions_are_not_offered(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.OPERATOR)
    detail = client.get(f"/deployments/{fleet.acme.name}/")
    offered = [key for key, _ in detail.context["scale_form"].fields["region"].choices]
    assert "aws:us-east-1" not in offered and "aws:eu-central-1" in offered
    response = client.post(f"/deployments/{fleet.acme.name}/scale/",
                           {"region": "aws:us-east-1", "replicas": "1", "confirm": "yes"})
    assert response.status_code == 400
    assert not Replica.objects.filter(deployment=fleet.acme, region__code="us-east-1").exists()


def test_operator_drains_a_ready_replica(  # type: ignore[no-untyped-def]
    signed_in, fleet, sent_tasks, django_capture_on_commit_callbacks,
):
    client = signed_in(Role.OPERATOR)
    ready = first(fleet, fleet.acme, S.READY)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/replicas/{ready.pk}/drain/", {"reason": "kernel update"})
    assert response.status_code == 302
    assert Replica.objects.get(pk=ready.pk).state == S.DRAINING
    event = AuditLog.objects.get(action="replica.draining", object_id=str(ready.pk))
    assert (event.actor, event.reason) == ("operator-platform", "kernel update")
    assert ("provisioning.terminate_replica", (ready.pk, "kernel update"),
            {"countdown": 30}) in sent_tasks
    page = client.get(response["Location"])
    assert b"is draining" in page.content


def test_draining_a_replica_that_does_not_serve_is_refused_with_the_reason(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.OPERATOR)
    pending = first(fleet, fleet.acme, S.PENDING)
    response = client.post(f"/replicas/{pending.pk}/drain/", follow=True)
    assert b"cannot go from pending to draining" in response.content
    assert Replica.objects.get(pk=pending.pk).state == S.PENDING


def test_tenant_operator_acts_on_its_own_replicas_but_not_shared_ones(signed_in, fleet, tenants):  # type: ignore[no-untyped-def]
    client = signed_in(Role.OPERATOR, tenants["acme"])
    shared = first(fleet, fleet.shared, S.READY)
    response = client.post(f"/replicas/{shared.pk}/drain/")
    assert response.status_code == 403 and b"platform staff only" in response.content
    assert b"/drain/" not in client.get(f"/deployments/{fleet.shared.name}/").content
    other = first(fleet, fleet.globex, S.READY)
    assert client.post(f"/replicas/{other.pk}/drain/").status_code == 404
    own = first(fleet, fleet.acme, S.READY)
    assert client.post(f"/replicas/{own.pk}/drain/").status_code == 302
    assert Replica.objects.get(pk=own.pk).state == S.DRAINING
    assert client.post(f"/plans/{fleet.plan.pk}/approve/").status_code == 403


def test_admin_creates_a_key_that_is_shown_once(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.ADMIN)
    response = client.post("/tenants/acme/keys/",
                           {"name": "mobile", "tier": "batch", "allowed_models": "a, b"})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    key = response.context["new_key"]
    assert key in response.content.decode()
    row = ApiKey.objects.get(tenant__name="acme", name="mobile")
    assert row.key_hash == sha256_hex(key) and row.allowed_models == ["a", "b"]
    assert row.tier == "batch"
    assert AuditLog.objects.filter(action="create", object_id=str(row.pk),
                                   actor="admin-platform").exists()
    assert key not in client.get("/tenants/acme/").content.decode()
    again = client.post("/tenants/acme/keys/", {"name": "mobile", "tier": "batch"})
    assert again.status_code == 400 and b"already has a key named" in again.content


def test_admin_revokes_a_key_once_and_it_is_recorded(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.ADMIN)
    key = ApiKey.objects.get(tenant__name="acme")
    assert client.post(f"/keys/{key.pk}/revoke/", {"reason": "leaked"}).status_code == 302
    client.post(f"/keys/{key.pk}/revoke/")
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert list(AuditLog.objects.filter(action="revoke", object_id=str(key.pk))
                .values_list("reason", flat=True)) == ["leaked"]


def test_tenant_admin_manages_its_own_keys_only(signed_in, fleet, tenants):  # type: ignore[no-untyped-def]
    client = signed_in(Role.ADMIN, tenants["acme"])
    form = {"name": "ci", "tier": "interactive"}
    assert client.post("/tenants/acme/keys/", form).status_code == 200
    assert client.post("/tenants/globex/keys/", form).status_code == 404
    globex_key = ApiKey.objects.get(tenant__name="globex")
    assert client.post(f"/keys/{globex_key.pk}/revoke/").status_code == 404


def test_operator_approves_then_applies_a_plan(  # type: ignore[no-untyped-def]
    signed_in, fleet, sent_tasks, django_capture_on_commit_callbacks,
):
    client = signed_in(Role.OPERATOR)
    url = f"/plans/{fleet.plan.pk}/"
    early = client.post(url + "apply/", follow=True)
    assert b"needs it to be approved" in early.content
    client.post(url + "approve/")
    assert Plan.objects.get(pk=fleet.plan.pk).status == PlanStatus.APPROVED
    with django_capture_on_commit_callbacks(execute=True):
        client.post(url + "apply/")
    assert Plan.objects.get(pk=fleet.plan.pk).status == PlanStatus.APPLYING
    actions = set(AuditLog.objects.filter(actor="operator-platform")
                  .values_list("action", flat=True))
    assert {"plan.approve", "plan.apply", "replica.requested"} <= actions
    assert any(name == "placement.advance_plan" for name, _, _ in sent_tasks)


def test_operator_rejects_a_plan_with_a_reason(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.OPERATOR)
    client.post(f"/plans/{fleet.plan.pk}/reject/", {"reason": "too risky today"})
    assert Plan.objects.get(pk=fleet.plan.pk).status == PlanStatus.REJECTED
    assert AuditLog.objects.get(action="plan.reject").reason == "too risky today"
    assert client.post(f"/plans/{fleet.plan.pk}/nonsense/").status_code == 404


def test_inventory_filters_sorts_marks_stale_and_paginates(signed_in, catalog, tenants):  # type: ignore[no-untyped-def]
    seed_fleet(catalog, tenants, regions=80, replicas=6, edges=1)
    client = signed_in(Role.VIEWER)
    first_page = client.get("/inventory/")
    assert first_page.context["page"].paginator.count == 6 + 77
    assert first_page.context["page"].paginator.num_pages == 2
    eu = client.get("/inventory/?jurisdiction=EU&gpu=H100&sort=on_demand")
    offers = list(eu.context["page"])
    assert offers and all(o.region.jurisdiction.code == "EU" and o.gpu_type.name == "H100"
                          for o in offers)
    prices = [o.on_demand_usd_h for o in offers]
    assert prices == sorted(prices)
    stale_before = eu.context["stale_before"]
    assert any(o.observed_at < stale_before for o in offers)
    assert any(o.observed_at >= stale_before for o in offers)
    html = eu.content.decode()
    assert html.count('class="badge stale"') >= sum(o.observed_at < stale_before for o in offers)
    quota = next(o for o in offers if o.quota_limit is not None)
    assert quota.quota_left == max(quota.quota_limit - quota.quota_used, 0)
    regions = client.get("/inventory/?tab=regions&gpu=L4")
    assert {r.key for r in regions.context["page"]} == {
        "aws:eu-central-1", "aws:us-east-1", "gcp:europe-west4"}
    assert all(r.offer_count == 2 for r in regions.context["page"])


def test_routing_shows_drift_and_the_diff_names_what_changed(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.VIEWER)
    edges = {e.name: e for e in client.get("/routing/").context["page"]}
    assert not edges["edge-0"].in_sync and edges["edge-1"].in_sync
    diff_page = client.get(f"/routing/{fleet.edges[0].name}/diff/")
    assert (diff_page.context["older"], diff_page.context["newer"]) == (1, 2)  # acked → newest
    diff = diff_page.context["diff"]
    assert len(diff.replicas_added) == 1 and diff.tenants_added
    assert [f.name for c in diff.replicas_changed for f in c.fields] == ["weight"]
    missing = client.get(f"/routing/{fleet.edges[0].name}/diff/?from=999&to=2")
    assert missing.context["missing"] == [999]


def test_events_filter_by_action_and_actor(signed_in, fleet):  # type: ignore[no-untyped-def]
    client = signed_in(Role.VIEWER)
    failed = client.get("/events/?action=replica.failed").context["page"]
    assert failed and {e.action for e in failed} == {"replica.failed"}
    assert not client.get("/events/?actor=nobody-at-all").context["page"]
    assert client.get("/events/").context["figure"]["data"]


def test_deployment_detail_shows_traffic_charts_from_samples(signed_in, fleet):  # type: ignore[no-untyped-def]
    context = signed_in(Role.VIEWER).get(f"/deployments/{fleet.acme.name}/").context
    assert set(context["figures"]) == {"latency", "throughput", "load", "kv"}
    assert context["series"].running[-1] == 3 * 4  # three sampled replicas, 4 running each
    quiet = signed_in(Role.VIEWER).get(f"/deployments/{fleet.globex.name}/")
    assert "figures" not in quiet.context and b"No metrics in the last" in quiet.content


def test_catalog_list_prices_show_their_date_and_are_never_stale(signed_in, catalog):  # type: ignore[no-untyped-def]
    from datetime import UTC, datetime

    from regions.models import Offer, Quota

    old = datetime(2025, 10, 1, tzinfo=UTC)
    Offer.objects.update(source="catalog:2025-10-01", observed_at=old)
    Quota.objects.update(source="catalog:2025-10-01", observed_at=old)  # default quota too
    html = signed_in(Role.VIEWER).get("/inventory/").content.decode()
    assert "list price, 2025-10-01" in html
    assert 'class="badge stale"' not in html.split("</p>", 1)[1]  # the lede explains the badge
    # Observations that should have refreshed and did not are still marked.
    Offer.objects.update(source="skypilot")
    html = signed_in(Role.VIEWER).get("/inventory/").content.decode()
    assert 'class="badge stale"' in html.split("</p>", 1)[1]
