"""The dashboard in Debian's Chromium through Playwright: sign in, every page renders with no
console errors, the map draws, an operator acts, a viewer sees no buttons and is refused.

Each page's screenshot is saved to artifacts/screenshots/<page>.png for people to look at.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.core.models import AuditLog, Role
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.placement.models import Plan, PlanStatus
from frontend.views.common import NAV
from tests.frontend.batch_rows import make_batch
from tests.frontend.fleet import Fleet, seed_fleet

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-quic", "--no-first-run",
]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
VIEWPORT = {"width": 1440, "height": 900}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run tools/ensure_chromium.sh")
    from playwright.sync_api import sync_playwright

    # Playwright's driver keeps an event loop in this thread; the tests' own ORM calls are
    # synchronous and run between browser steps, never inside that loop.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            yield chromium
            chromium.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


class Tab:
    """A browser page that records console errors, page errors and failed requests."""

    def __init__(self, page: Any, base_url: str) -> None:
        self.page, self.base_url = page, base_url
        self.problems: list[str] = []

        def console(m: Any) -> None:
            if m.type == "error":
                self.problems.append(f"console: {m.text} ({page.url})")

        def request_failed(r: Any) -> None:
            # A request cut short because the test moved on to the next page is not a fault.
            if r.failure != "net::ERR_ABORTED":
                self.problems.append(f"request failed: {r.url} {r.failure}")

        page.on("console", console)
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e} ({page.url})"))
        page.on("requestfailed", request_failed)

    def open(self, path: str) -> Any:
        response = self.page.goto(self.base_url + path, wait_until="load")
        assert response is not None and response.status == 200, (path, response and response.status)
        return response

    def sign_in(self, username: str) -> None:
        self.page.goto(self.base_url + "/login/")
        self.page.fill("#id_username", username)
        self.page.fill("#id_password", f"pw-{username}")
        self.page.click("button[type=submit]")
        self.page.wait_for_url(self.base_url + "/")

    def shoot(self, name: str) -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)

    def forge_post(self, path: str, form: dict[str, str]) -> int:
        """POST as this page's script could, with the session's CSRF token: the status."""
        return int(self.page.evaluate(
            """async ([url, form]) => {
                const token = document.cookie.split('; ').find(c => c.startsWith('csrftoken='))
                    .split('=')[1];
                const body = new URLSearchParams(form);
                const r = await fetch(url, {method: 'POST', body,
                                            headers: {'X-CSRFToken': token}});
                return r.status;
            }""", [self.base_url + path, form]))


@pytest.fixture
def tab(browser: Any, live_server: Any) -> Iterator[Callable[[], Tab]]:
    contexts = []

    def open_tab() -> Tab:
        context = browser.new_context(viewport=VIEWPORT)
        contexts.append(context)
        return Tab(context.new_page(), live_server.url)

    yield open_tab
    for context in contexts:
        context.close()


@pytest.fixture
def browser_fleet(catalog: dict[str, Any], tenants: dict[str, Any]) -> Fleet:
    return seed_fleet(catalog, tenants, regions=40, replicas=60, edges=3)


def test_every_page_renders_without_errors_and_the_map_draws(
    tab: Callable[[], Tab], browser_fleet: Fleet, make_user: Callable[..., Any],
) -> None:
    make_user(Role.ADMIN, username="ada")
    batch = make_batch(browser_fleet.acme.tenant, done=40, failed=3, running=2, queued=55)
    page = tab()
    page.open("/login/")
    page.shoot("sign-in")
    page.sign_in("ada")
    assert page.page.locator("nav[aria-label=Main] a").count() == len(NAV)

    page.page.wait_for_selector("#world-map .scattergeo", state="attached")
    assert page.page.locator("#world-map .geolayer").count() == 1
    assert page.page.locator("#world-map .scattergeo path.point").count() >= 40
    # The coastlines come from the vendored topojson: a long path once it has loaded.
    land = page.page.locator("#world-map .layer.land path").first.get_attribute("d") or ""
    assert len(land) > 10_000
    page.shoot("overview")
    # The live parts re-fetch themselves with htmx; ask for them now instead of waiting.
    for part in ("#overview-figures", "#overview-attention"):
        with page.page.expect_response(lambda r: "/live/overview/" in r.url) as answer:
            page.page.evaluate(
                "part => htmx.ajax('GET', document.querySelector(part).getAttribute('hx-get'),"
                " {target: part, swap: 'outerHTML'})", part)
        assert answer.value.status == 200
    page.page.wait_for_selector("#overview-figures .card")

    pages = [
        ("inventory", "/inventory/", "table"),
        ("inventory-regions", "/inventory/?tab=regions&jurisdiction=EU", "table"),
        ("deployments", "/deployments/", "table"),
        ("deployment", f"/deployments/{browser_fleet.acme.name}/", "#chart-latency .scatterlayer"),
        ("plans", "/plans/", "table"),
        ("plan", f"/plans/{browser_fleet.plan.pk}/", "table"),
        ("routing", "/routing/", "#edge-table table"),
        ("routing-diff", f"/routing/{browser_fleet.edges[0].name}/diff/", ".diff-add"),
        ("events", "/events/", "#events-chart .barlayer"),
        ("costs", "/costs/", "main h1"),
        ("alerts", "/alerts/", "main h1"),
        ("failover", "/failover/", "main h1"),
        ("rollouts", "/rollouts/", "table"),
        ("batches", "/batches/", "#batch-table table"),
        ("batch", f"/batches/{batch.pk}/", "#batch-progress .scatterlayer"),
        ("tenants", "/tenants/", "table"),
        ("tenant", "/tenants/acme/", "table"),
    ]
    for name, path, ready in pages:
        page.open(path)
        page.page.wait_for_selector(ready, state="attached")
        page.shoot(name)
    assert page.problems == []


def test_operator_drains_a_replica_scales_and_applies_a_plan(
    tab: Callable[[], Tab], browser_fleet: Fleet, catalog: dict[str, Any],
    make_user: Callable[..., Any],
    sent_tasks: list[tuple[str, tuple[Any, ...], dict[str, Any]]],
) -> None:
    make_user(Role.OPERATOR, username="otto")
    page = tab()
    page.sign_in("otto")
    page.page.on("dialog", lambda dialog: dialog.accept())

    # The plan first: it was computed from the fleet as it stands, and a drain or a scale
    # would move that fleet and make the plan stale (tests/frontend/test_stale_plan_pages.py).
    page.open(f"/plans/{browser_fleet.plan.pk}/")
    page.page.click("button:has-text('Approve')")
    page.page.wait_for_selector("text=approved.")
    page.page.click("button:has-text('Apply')")
    page.page.wait_for_selector("text=is being applied")
    assert Plan.objects.get(pk=browser_fleet.plan.pk).status == PlanStatus.APPLYING
    assert re.search(r"plan\.apply", "".join(
        AuditLog.objects.filter(actor="otto").values_list("action", flat=True)))

    page.open(f"/deployments/{browser_fleet.acme.name}/")
    drain_button = page.page.locator("button", has_text="Drain")
    row = page.page.locator("#replica-table tr", has=drain_button).first
    replica_id = int(row.locator("td").first.inner_text().split()[0].removeprefix("r-"))
    row.locator("button", has_text="Drain").click()
    page.page.wait_for_selector(".message.success")
    assert Replica.objects.get(pk=replica_id).state == S.DRAINING
    assert AuditLog.objects.filter(action="replica.draining", actor="otto",
                                   object_id=str(replica_id)).exists()
    assert ("provisioning.terminate_replica", (replica_id, "drained by otto"),
            {"countdown": 30}) in sent_tasks

    region = catalog["ams"]
    before = Replica.objects.filter(deployment=browser_fleet.acme, region=region,
                                    state__in=[S.PENDING]).count()
    page.page.select_option("#id_region", region.key)
    page.page.fill("#id_replicas", "9")
    page.page.fill("#id_reason", "more EU capacity")
    page.page.click("text=Review change")
    page.page.wait_for_selector("text=Nothing has changed yet")
    page.shoot("scale-confirm")
    page.page.click("button:has-text('Confirm')")
    page.page.wait_for_selector(".message.success")
    assert Replica.objects.filter(deployment=browser_fleet.acme, region=region,
                                  state=S.PENDING).count() > before

    assert page.problems == []


def test_viewer_sees_no_action_buttons_and_forged_posts_are_refused(
    tab: Callable[[], Tab], browser_fleet: Fleet, make_user: Callable[..., Any],
) -> None:
    make_user(Role.VIEWER, username="vera")
    page = tab()
    page.sign_in("vera")
    detail = f"/deployments/{browser_fleet.acme.name}/"
    page.open(detail)
    assert page.page.locator("#replica-table tbody tr").count() > 0
    assert page.page.locator("button", has_text="Drain").count() == 0
    assert page.page.locator("text=Scale in a region").count() == 0
    page.open(f"/plans/{browser_fleet.plan.pk}/")
    assert page.page.locator("button", has_text="Approve").count() == 0
    page.open("/tenants/acme/")
    assert page.page.locator("text=Create a key").count() == 0
    assert page.page.locator("button", has_text="Revoke").count() == 0

    ready = next(r for r in browser_fleet.replicas
                 if r.deployment_id == browser_fleet.acme.pk and r.state == S.READY)
    forged = {
        f"/replicas/{ready.pk}/drain/": {"reason": "forged"},
        f"{detail}scale/": {"region": "aws:eu-central-1", "replicas": "0", "confirm": "yes"},
        f"/plans/{browser_fleet.plan.pk}/approve/": {},
        "/tenants/acme/keys/": {"name": "forged", "tier": "interactive"},
        "/failover/drill/": {"region": "aws:eu-central-1", "confirm": "yes"},
    }
    for path, form in forged.items():
        assert page.forge_post(path, form) == 403, path
    assert Replica.objects.get(pk=ready.pk).state == S.READY
    assert Plan.objects.get(pk=browser_fleet.plan.pk).status == PlanStatus.PROPOSED
    assert not AuditLog.objects.filter(actor="vera").exists()
    page.open(detail)
    page.shoot("viewer-deployment")


def test_operator_starts_a_drill_that_appears_on_the_timeline(
    tab: Callable[[], Tab], browser_fleet: Fleet, catalog: dict[str, Any],
    make_user: Callable[..., Any],
) -> None:
    from controlplane.failover.models import Incident, IncidentKind
    from regions.models import Cloud, Region

    cloud = Cloud.objects.create(name="local", display_name="Local lab")
    lab = Region.objects.create(cloud=cloud, code="eu-frankfurt", display_name="Lab Frankfurt",
                                latitude=50.1, longitude=8.7, country="DE",
                                jurisdiction=catalog["eu"])
    # A replica row with no process behind it: the drill records itself and kills nothing.
    victim = Replica.objects.create(deployment=browser_fleet.acme, region=lab,
                                    provider="local", state=S.READY)
    make_user(Role.OPERATOR, username="olga")
    page = tab()
    page.sign_in("olga")
    page.open("/failover/")
    page.page.select_option("select[name=region]", "local:eu-frankfurt")
    page.page.click("button:has-text('Review drill')")
    page.page.wait_for_selector("text=Nothing has happened yet")
    assert page.page.locator(f"code:has-text('{victim.public_id}')").count() == 1
    page.shoot("drill-confirm")
    page.page.click("button:has-text('Confirm: kill 1 replica')")
    page.page.wait_for_selector(".message.success")
    incident = Incident.objects.get(kind=IncidentKind.DRILL)
    assert incident.started_by == "olga" and incident.region == lab
    row = page.page.locator("table.data tr", has_text=f"Drill: kill 1 replica in {lab.key}")
    assert row.count() == 1 and "open" in row.inner_text()
    page.page.wait_for_selector("#incident-timelines .scatterlayer", state="attached")
    page.shoot("failover")
    assert page.problems == []


def test_operator_pauses_and_rolls_back_a_rollout_from_its_timeline(
    tab: Callable[[], Tab], browser_fleet: Fleet, make_user: Callable[..., Any],
) -> None:
    from controlplane.rollouts import analyst, lifecycle
    from controlplane.rollouts.models import Rollout
    from tests.rollouts.starting import start_rollout

    rollout = start_rollout(browser_fleet.acme, actor="ops", steps=[5, 50, 100], bake_s=30)
    side = {"edges": 1, "requests": 120.0, "errors": 0.0, "error_rate": 0.0,
            "ttft_p95_s": 0.2, "itl_p95_s": 0.02}
    lifecycle.advance(rollout.pk, actor=analyst.ANALYST, figures={
        "verdict": "pass", "why": "within", "checks": [],
        "stable": {**side, "revision": 1}, "canary": {**side, "revision": 2, "ttft_p95_s": 0.21}})
    make_user(Role.OPERATOR, username="rita")
    page = tab()
    page.sign_in("rita")
    page.page.on("dialog", lambda dialog: dialog.accept())
    page.open("/rollouts/")
    page.page.click(f"#rollout-{rollout.pk} a")
    page.page.wait_for_selector("#rollout-chart .barlayer", state="attached")
    assert "200 ms / 210 ms" in page.page.locator("#step-0").inner_text()
    page.shoot("rollout")
    page.page.fill("input[aria-label='Reason to pause']", "looking at the canary")
    page.page.click("button:has-text('Pause')")
    page.page.wait_for_selector(".message.success")
    assert Rollout.objects.get(pk=rollout.pk).state == "paused"
    page.page.click("button:has-text('Roll back')")
    page.page.wait_for_selector(".message.success")
    rolled = Rollout.objects.get(pk=rollout.pk)
    assert rolled.state == "rolled_back" and rolled.ended_by == "rita"
    assert AuditLog.objects.filter(actor="rita", action__in=[
        "rollout.paused", "rollout.rolled_back"]).count() == 2
    assert page.page.locator("button", has_text="Resume").count() == 0
    assert page.problems == []


def test_the_failover_page_follows_a_drill_without_a_reload(
    tab: Callable[[], Tab], browser_fleet: Fleet, catalog: dict[str, Any],
    make_user: Callable[..., Any],
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.failover.models import Incident, IncidentKind

    now = timezone.now()
    incident = Incident.objects.create(kind=IncidentKind.DRILL, region=catalog["fra"],
                                       summary="Drill: kill 2 replicas", started_at=now)
    make_user(Role.VIEWER, username="vera")
    page = tab()
    page.sign_in("vera")
    page.open("/failover/")
    row = page.page.locator("#failover-live table.data tr", has_text="Drill: kill 2 replicas")
    assert "open" in row.inner_text()
    assert page.page.locator("#failover-live").get_attribute("hx-trigger") == "every 2s"
    # Failover acts in the database; the page is never reloaded.
    Incident.objects.filter(pk=incident.pk).update(
        detected_at=now + timedelta(seconds=0.4), tables_pushed_at=now + timedelta(seconds=0.9),
        replacements=["r-1"], replacement_ready_at=now + timedelta(seconds=4),
        traffic_back_at=now + timedelta(seconds=6), resolved_at=now + timedelta(seconds=6.5))
    page.page.wait_for_function(
        "() => { const r = [...document.querySelectorAll('#failover-live tr')]"
        ".find(t => t.textContent.includes('Drill: kill 2 replicas'));"
        " return r && r.textContent.includes('resolved') && r.textContent.includes('+6.50 s'); }",
        timeout=20_000)
    # Settled: the part now refreshes at the quiet pace.
    assert page.page.locator("#failover-live").get_attribute("hx-trigger") == "every 15s"
    assert page.problems == []


def test_region_markers_are_drawn_above_the_edges_and_a_down_region_shows(
    tab: Callable[[], Tab], browser_fleet: Fleet, make_user: Callable[..., Any],
) -> None:
    from django.utils import timezone

    from controlplane.failover.models import Health, RegionHealth

    edge_region = browser_fleet.edges[0].region
    now = timezone.now()
    RegionHealth.objects.update_or_create(region=edge_region, defaults={
        "state": Health.DOWN, "reason": "2 replicas failed and none serves",
        "changed_at": now, "checked_at": now})
    make_user(Role.VIEWER, username="vic")
    page = tab()
    page.sign_in("vic")
    page.page.wait_for_selector("#world-map .scattergeo path.point", state="attached")
    names = page.page.evaluate(
        "() => document.getElementById('world-map').data.map(t => t.name)")
    edges = next(i for i, n in enumerate(names) if n.startswith("edges"))
    regions = [i for i, n in enumerate(names) if n.split(" ")[0] in
               ("idle", "starting", "healthy", "degraded", "down")]
    assert regions and min(regions) > edges and names[-1].startswith("down"), names
    # Drawn last in the SVG (on top), and bigger than an edge's diamond.
    sizes = page.page.evaluate(
        """() => { const traces = [...document.querySelectorAll('#world-map .scattergeo.trace')];
                   const box = t => t.querySelector('path.point').getBoundingClientRect().width;
                   return [box(traces[traces.length - 1]), traces.length]; }""")
    edge_width = page.page.evaluate(
        """(i) => { const t = document.querySelectorAll('#world-map .scattergeo.trace')[i];
                    return t.querySelector('path.point').getBoundingClientRect().width; }""",
        edges)  # one SVG trace per figure trace, in the same order
    assert sizes[0] > edge_width > 0
    assert page.problems == []


def test_operator_cancels_a_batch_after_the_review_and_the_page_follows_it(
    tab: Callable[[], Tab], tenants: dict[str, Any], make_user: Callable[..., Any],
) -> None:
    from controlplane.batches.models import Batch, BatchStatus

    batch = make_batch(tenants["acme"], done=5, failed=1, running=1, queued=13)
    make_user(Role.OPERATOR, username="otto")
    page = tab()
    page.sign_in("otto")
    page.open("/batches/")
    page.page.click(f"a:has-text('{batch.pk}')")
    page.page.wait_for_selector("#batch-summary [role=progressbar]")
    assert page.page.locator("#batch-errors tbody tr").count() == 1
    page.page.fill("#batch-summary input[name=reason]", "wrong prompts")
    page.page.click("button:has-text('Cancel batch')")
    page.page.wait_for_selector("text=Nothing has happened yet")
    page.shoot("batch-cancel-confirm")
    page.page.click("button:has-text('Confirm: cancel this batch')")
    page.page.wait_for_selector(".message.success")
    # A line was in flight: the batch waits in cancelling for it.
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.CANCELLING
    assert AuditLog.objects.get(object_id=batch.pk, action="batch.cancelling").reason == \
        "wrong prompts"
    assert page.page.locator("#batch-summary").get_attribute("data-status") == "cancelling"
    # The worker finishes it; the summary follows without a reload.
    from controlplane.batches import results

    results.finalize(batch.pk, BatchStatus.CANCELLED)
    page.page.wait_for_function(
        "() => document.querySelector('#batch-summary').dataset.status === 'cancelled'",
        timeout=20_000)
    assert page.page.locator("button", has_text="Cancel batch").count() == 0
    assert page.problems == []
