"""The Batches page: progress, counts, tokens and ETA per batch; a batch's failed lines by
line number; tenants see only their own batches; operators cancel after a review, as
themselves in the audit log; a finished batch or an unknown id is refused plainly."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.messages import get_messages
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from controlplane.batches import progress
from controlplane.batches.cost import batch_cost
from controlplane.batches.models import Batch, BatchStatus
from controlplane.core.models import AuditLog, Role
from controlplane.core.money import format_usd
from frontend.templatetags.meridian import duration, ratio, usd_fine
from tests.frontend.batch_rows import finish, make_batch

pytestmark = pytest.mark.django_db

MOST_QUERIES = 15


def text(response: Any) -> str:
    return re.sub(r"\s+", " ", response.content.decode())


def flash(response: Any) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def test_eta_is_the_rest_at_the_recent_pace_and_unknown_without_one() -> None:
    cases = [  # remaining, finished in the window, window seconds, ETA, why
        (100, 50, 300.0, 600.0, "50 lines in 5 min: 100 more take 10 min"),
        (0, 0, 300.0, 0.0, "nothing left"),
        (10, 0, 300.0, None, "nothing finished lately: no pace to go by"),
        (10, 5, 0.0, None, "no time measured"),
    ]
    for remaining, recent, window, expected, why in cases:
        assert progress.eta_s(remaining, recent, window) == expected, why


def test_durations_read_in_two_units_and_a_dash_when_unknown() -> None:
    assert [duration(s) for s in (None, 42, 600, 3 * 3600 + 20 * 60, 2 * 86400 + 3600)] == [
        "—", "42 s", "10 min", "3 h 20 min", "2 d 1 h"]


def test_the_list_shows_each_batch_with_its_progress_counts_tokens_and_eta(
        signed_in: Any, tenants: Any) -> None:
    running = make_batch(tenants["acme"], done=30, failed=10, running=4, queued=56,
                         finished_over_s=120)
    done = finish(make_batch(tenants["globex"], done=8, failed=0))
    client = signed_in(Role.VIEWER)
    page = client.get(reverse("frontend:batches"))
    assert page.status_code == 200
    body = text(page)
    row = re.search(rf'<tr data-batch="{running.pk}">(.*?)</tr>', body).group(1)  # type: ignore[union-attr]
    assert "acme" in row and "llama-3.1-8b" in row and "in_progress" in row
    assert 'aria-valuenow="40"' in row and 'aria-valuemax="100"' in row
    assert "width: 30.00%" in row and "width: 10.00%" in row and "40.0%" in row
    assert ">30<" in row and ">100<" in row and ">150<" in row  # completed, total, 30×5 tokens
    # 40 lines in the 2 minutes since it started; 60 left take 3 minutes at that pace.
    assert ">3 min<" in row
    finished = re.search(rf'<tr data-batch="{done.pk}">(.*?)</tr>', body).group(1)  # type: ignore[union-attr]
    assert "completed" in finished and "100.0%" in finished and ">—<" in finished
    assert done.completed_at is not None
    assert f"{done.completed_at:%b} {done.completed_at.day}" in finished
    # While a batch runs, the table refreshes every 2 s.
    assert 'id="batch-table"' in body and 'hx-trigger="every 2s"' in body
    assert ">2 batches<" in body


def test_the_eta_is_unknown_until_a_line_finishes(signed_in: Any, tenants: Any) -> None:
    fresh = make_batch(tenants["acme"], queued=10)
    body = text(signed_in(Role.VIEWER).get(reverse("frontend:batch", args=[fresh.pk])))
    assert "Not known until lines finish at a steady pace." in body


def test_a_tenant_user_sees_only_their_tenants_batches(signed_in: Any, tenants: Any) -> None:
    own = make_batch(tenants["acme"], done=1, queued=1)
    other = make_batch(tenants["globex"], done=1, queued=1)
    client = signed_in(Role.OPERATOR, tenants["acme"])
    body = text(client.get(reverse("frontend:batches")))
    assert own.pk in body and other.pk not in body
    assert client.get(reverse("frontend:batches-live")).content.decode().count("data-batch=") == 1
    # Another tenant's batch is a 404 everywhere, as an unknown one.
    for name in ("batch", "batch-summary"):
        assert client.get(reverse(f"frontend:{name}", args=[other.pk])).status_code == 404
    assert client.post(reverse("frontend:batch-cancel", args=[other.pk]),
                       {"confirm": "yes"}).status_code == 404
    assert Batch.objects.get(pk=other.pk).status == BatchStatus.IN_PROGRESS
    assert client.get(reverse("frontend:batch", args=[own.pk])).status_code == 200


def test_an_unknown_batch_is_404(signed_in: Any) -> None:
    client = signed_in(Role.ADMIN)
    for name in ("batch", "batch-summary"):
        assert client.get(reverse(f"frontend:{name}", args=["batch_nope"])).status_code == 404
    count = AuditLog.objects.count()
    assert client.post(reverse("frontend:batch-cancel", args=["batch_nope"]),
                       {"confirm": "yes"}).status_code == 404
    assert AuditLog.objects.count() == count


def test_the_detail_lists_failed_lines_by_line_number_with_their_errors(
        signed_in: Any, tenants: Any) -> None:
    batch = make_batch(tenants["acme"], done=2, failed=3, queued=1)
    body = text(signed_in(Role.VIEWER, tenants["acme"]).get(
        reverse("frontend:batch", args=[batch.pk])))
    table = re.search(r'<table id="batch-errors">(.*?)</table>', body).group(1)  # type: ignore[union-attr]
    rows = re.findall(r'<tr> <td class="num">(\d+)</td> <td class="mono">([^<]+)</td>', table)
    assert rows == [("3", "req-3"), ("4", "req-4"), ("5", "req-5")]
    assert "bad prompt on line 3" in table and "http_400" in table
    assert "TimeoutError (after 5 attempts)" in table and "request_failed" in table
    assert "10 tokens used" in body
    # Lines finished in the last minutes: the progress chart is drawn.
    assert 'id="batch-progress"' in body


def test_an_operator_cancels_after_a_review_and_the_log_names_them(
        signed_in: Any, tenants: Any) -> None:
    batch = make_batch(tenants["acme"], done=3, failed=1, queued=6)
    client = signed_in(Role.OPERATOR)
    detail = text(client.get(reverse("frontend:batch", args=[batch.pk])))
    assert "Cancel batch…" in detail
    url = reverse("frontend:batch-cancel", args=[batch.pk])
    review = client.post(url, {"reason": "runaway job"})
    assert review.status_code == 200
    body = text(review)
    assert "Nothing has happened yet" in body and "6 queued lines" in body
    assert "3 completed and 1 failed lines" in body and 'value="runaway job"' in body
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.IN_PROGRESS
    assert not AuditLog.objects.filter(object_id=batch.pk).exclude(
        action="batch.created").exists()

    done = client.post(url, {"reason": "runaway job", "confirm": "yes"})
    assert done.status_code == 302 and done["Location"] == reverse("frontend:batch",
                                                                   args=[batch.pk])
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.CANCELLED
    assert flash(done) == [f"Batch {batch.pk} is cancelled: 3 completed and 1 failed results "
                           "are kept."]
    events = AuditLog.objects.filter(object_id=batch.pk).exclude(action="batch.created")
    assert {(e.action, e.actor, e.reason) for e in events} == {
        ("batch.cancelling", "operator-platform", "runaway job"),
        ("batch.finalizing", "operator-platform", "runaway job"),
        ("batch.cancelled", "operator-platform", "runaway job")}
    assert all(e.tenant_id == tenants["acme"].pk for e in events)
    after = text(client.get(reverse("frontend:batch", args=[batch.pk])))
    assert "Cancel batch…" not in after and "batch.cancelled" in after


def test_a_batch_with_lines_in_flight_is_left_cancelling(signed_in: Any, tenants: Any) -> None:
    batch = make_batch(tenants["acme"], done=1, running=2, queued=3)
    client = signed_in(Role.OPERATOR, tenants["acme"])  # a tenant's operator, own batch
    done = client.post(reverse("frontend:batch-cancel", args=[batch.pk]), {"confirm": "yes"})
    assert done.status_code == 302
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.CANCELLING
    assert "is cancelling: no line is sent from now on" in flash(done)[0]
    assert AuditLog.objects.get(object_id=batch.pk, action="batch.cancelling").actor == \
        "operator-acme"


@pytest.mark.parametrize("status", [BatchStatus.COMPLETED, BatchStatus.CANCELLED,
                                    BatchStatus.EXPIRED])
def test_cancelling_a_finished_batch_is_refused_plainly(signed_in: Any, tenants: Any,
                                                        status: str) -> None:
    batch = finish(make_batch(tenants["acme"], done=2), status)
    client = signed_in(Role.OPERATOR)
    assert "Cancel batch…" not in text(client.get(reverse("frontend:batch", args=[batch.pk])))
    count = AuditLog.objects.count()
    for form in ({}, {"confirm": "yes"}):
        refused = client.post(reverse("frontend:batch-cancel", args=[batch.pk]), form)
        assert refused.status_code == 302
        assert flash(refused)[-1] == (f"Not cancelled: batch {batch.pk} has already finished "
                                      f"({status}); there is nothing left to stop.")
    assert AuditLog.objects.count() == count
    assert Batch.objects.get(pk=batch.pk).status == status


def test_viewers_cannot_cancel_and_a_bad_reason_changes_nothing(signed_in: Any,
                                                                tenants: Any) -> None:
    batch = make_batch(tenants["acme"], done=1, queued=2)
    url = reverse("frontend:batch-cancel", args=[batch.pk])
    viewer = signed_in(Role.VIEWER)
    assert "Cancel batch…" not in text(viewer.get(reverse("frontend:batch", args=[batch.pk])))
    assert viewer.post(url, {"confirm": "yes"}).status_code == 403
    assert viewer.get(url).status_code == 405

    operator = signed_in(Role.OPERATOR)
    refused = operator.post(url, {"reason": "x" * 501, "confirm": "yes"})
    assert refused.status_code == 302
    assert flash(refused) == ["Not cancelled: the reason Ensure this value has at most 500 "
                              "characters (it has 501)."]
    assert Batch.objects.get(pk=batch.pk).status == BatchStatus.IN_PROGRESS
    assert not AuditLog.objects.filter(object_id=batch.pk).exclude(
        action="batch.created").exists()


def test_the_live_summary_follows_the_batch(signed_in: Any, tenants: Any) -> None:
    batch = make_batch(tenants["acme"], done=1, queued=1)
    client = signed_in(Role.VIEWER)
    url = reverse("frontend:batch-summary", args=[batch.pk])
    live = text(client.get(url))
    assert 'data-status="in_progress"' in live and 'hx-trigger="every 2s"' in live
    finish(batch)
    live = text(client.get(url))
    assert 'data-status="completed"' in live and 'hx-trigger="every 15s"' in live
    assert ">done<" in live


@pytest.mark.parametrize("scope", ["platform", "tenant"])
def test_the_pages_queries_do_not_grow_with_the_batches(signed_in: Any, tenants: Any,
                                                       scope: str) -> None:
    client = signed_in(Role.ADMIN, tenants["acme"] if scope == "tenant" else None)
    first = make_batch(tenants["acme"], done=2, failed=1, queued=1)

    def counts() -> list[int]:
        out = []
        for url in (reverse("frontend:batches"), reverse("frontend:batches-live"),
                    reverse("frontend:batches") + "?status=unfinished&q=llama",
                    reverse("frontend:batch", args=[first.pk]),
                    reverse("frontend:batch-summary", args=[first.pk])):
            with CaptureQueriesContext(connection) as queries:
                assert client.get(url).status_code == 200, url
            out.append(len(queries))
        return out

    counts()  # each batch's cost is worked out once, then kept (test_costs_are_kept)
    small = counts()
    for i in range(12):
        make_batch(tenants["acme" if i % 2 else "globex"], done=3, failed=2, queued=4)
    counts()
    assert counts() == small
    assert max(small) <= MOST_QUERIES


def test_a_bad_filter_shows_no_batches_and_says_why(signed_in: Any, tenants: Any) -> None:
    make_batch(tenants["acme"], done=1)
    body = text(signed_in(Role.VIEWER).get(reverse("frontend:batches") + "?status=nonsense"))
    assert "status: Select a valid choice." in body and "data-batch=" not in body


def test_eta_uses_only_the_last_minutes(tenants: Any) -> None:
    """Lines that finished long ago do not count toward the pace."""
    from django.utils import timezone

    now = timezone.now()
    old = make_batch(tenants["acme"], done=10, queued=10, finished_over_s=3600, now=now)
    recent = progress.progress_of([old], now=now)[old.pk]
    # 10 lines, one every 6 minutes over the last hour: one in the last 5 minutes, so
    # 10 more take 10 × 5 minutes.
    assert recent.eta_s == pytest.approx(10 * 300)
    late = progress.progress_of([old], now=now + timedelta(minutes=10))[old.pk]
    assert late.eta_s is None


def test_a_cancelling_batch_has_no_eta_and_its_page_shows_its_files_events(
        signed_in: Any, tenants: Any) -> None:
    batch = make_batch(tenants["acme"], done=5, running=1, queued=10)
    assert progress.progress_of([batch])[batch.pk].eta_s is not None
    Batch.objects.filter(pk=batch.pk).update(status=BatchStatus.CANCELLING)
    batch.refresh_from_db()
    assert progress.progress_of([batch])[batch.pk].eta_s is None
    body = text(signed_in(Role.VIEWER).get(reverse("frontend:batch", args=[batch.pk])))
    assert "file.uploaded" in body and "batch.created" in body and "batch.cancelling" in body


@pytest.fixture
def priced(catalog: Any) -> Any:
    """The batches' model on one replica at the catalog's H100 price since two hours ago,
    its engine's token counters sampled before and while the batches run."""
    from django.utils import timezone

    from controlplane.deployments.models import Deployment, Replica
    from controlplane.telemetry.models import ReplicaSample
    from regions.models import Offer

    now = timezone.now()
    deployment = Deployment.objects.create(name="llama", served_model_name="llama-3.1-8b",
                                           model=catalog["llama8b"])
    offer = Offer.objects.get(region=catalog["fra"], gpu_type=catalog["h100"])
    replica = Replica.objects.create(deployment=deployment, region=catalog["fra"], offer=offer,
                                     state="ready")
    Replica.objects.filter(pk=replica.pk).update(created_at=now - timedelta(hours=2),
                                                 state_changed_at=now - timedelta(hours=2))
    for ago_s, tokens in ((400, 0), (240, 1000), (120, 3000), (0, 9000)):
        ReplicaSample.objects.create(replica=replica, at=now - timedelta(seconds=ago_s),
                                     counters={"prompt_tokens": tokens / 2,
                                               "generation_tokens": tokens / 2})
    return replica


def test_money_under_a_cent_keeps_four_figures() -> None:
    assert [usd_fine(v) for v in (None, 0, 0.003412, 0.5, 12.289)] == [
        "—", "$0.00", "$0.003412", "$0.50", "$12.29"]


def test_each_batch_shows_its_cost_and_its_price_beside_the_interactive_one(
        signed_in: Any, tenants: Any, priced: Any) -> None:
    batch = finish(make_batch(tenants["acme"], done=40, failed=2, finished_over_s=120))
    cost = batch_cost(batch)
    assert cost.usd is not None and cost.usd > 0 and cost.ratio_vs_interactive is not None
    client = signed_in(Role.VIEWER, tenants["acme"])
    body = text(client.get(reverse("frontend:batches")))
    row = re.search(rf'<tr data-batch="{batch.pk}">(.*?)</tr>', body).group(1)  # type: ignore[union-attr]
    assert usd_fine(cost.usd) in row
    assert format_usd(cost.usd_per_mtok, per_mtok=True) in row
    assert f"{ratio(cost.ratio_vs_interactive)} interactive" in row
    detail = text(client.get(reverse("frontend:batch", args=[batch.pk])))
    assert (f"Interactive {format_usd(cost.interactive_usd_per_mtok, per_mtok=True)}/Mtok "
            "just before it began") in detail


def test_a_batch_not_started_has_spent_nothing(signed_in: Any, tenants: Any) -> None:
    batch = make_batch(tenants["acme"], queued=3)
    Batch.objects.filter(pk=batch.pk).update(status=BatchStatus.VALIDATING, in_progress_at=None)
    body = text(signed_in(Role.VIEWER).get(reverse("frontend:batch", args=[batch.pk])))
    assert "Not started: nothing spent yet." in body


def test_costs_are_kept_and_worked_out_again_when_the_status_changes(
        tenants: Any, priced: Any) -> None:
    batch = make_batch(tenants["acme"], done=4, queued=4)
    first = progress.costs_of([batch])[batch.pk]
    with CaptureQueriesContext(connection) as queries:
        assert progress.costs_of([batch])[batch.pk] == first
    assert len(queries) == 0
    finish(batch)
    with CaptureQueriesContext(connection) as queries:
        progress.costs_of([batch])
    assert len(queries) > 0
