"""What a batch cost: its tokens' share of what its model's replicas cost and served while it
ran, beside the $/Mtok of the same length of time before it began; in the batch's API answer
under `meridian`, which the openai client leaves alone."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from controlplane.batches.cost import batch_cost, counter_growth, served_tokens
from controlplane.batches.models import Batch, BatchFile, BatchLine, LineState
from controlplane.deployments.models import Deployment, Replica
from controlplane.telemetry.models import ReplicaSample
from regions.models import Offer

from .test_batch_api import client

T0 = datetime(2026, 11, 20, 10, tzinfo=UTC)
FRA_H100 = Decimal("12.29")  # the fixture catalog's price
KEYS = ("prompt_tokens", "generation_tokens")


def test_counter_growth_counts_again_from_zero_after_a_restart() -> None:
    samples = [(T0, {"prompt_tokens": 100.0, "generation_tokens": 50.0}),
               (T0, {"prompt_tokens": 160.0, "generation_tokens": 90.0}),
               (T0, {"prompt_tokens": 20.0, "generation_tokens": 5.0}),   # restarted
               (T0, {"prompt_tokens": 30.0, "generation_tokens": 5.0})]
    assert counter_growth(samples, KEYS, from_zero=False) == 60 + 40 + 25 + 10
    assert counter_growth(samples[:1], KEYS, from_zero=True) == 150
    assert counter_growth([], KEYS, from_zero=True) == 0


def _sample(replica: Replica, at: datetime, prompt: float, generation: float) -> None:
    ReplicaSample.objects.create(replica=replica, at=at,
                                 counters={"prompt_tokens": prompt,
                                           "generation_tokens": generation})


@pytest.mark.django_db
def test_served_tokens_count_an_engine_restart_inside_the_window(catalog: Any) -> None:
    deployment = Deployment.objects.create(name="chat", served_model_name="llama-3.1-8b",
                                           model=catalog["llama8b"])
    replica = Replica.objects.create(deployment=deployment, region=catalog["fra"], state="ready")
    Replica.objects.filter(pk=replica.pk).update(created_at=T0 - timedelta(hours=2))
    _sample(replica, T0 - timedelta(minutes=1), 1000, 1000)   # the counters at the start
    _sample(replica, T0 + timedelta(minutes=2), 1500, 1500)
    _sample(replica, T0 + timedelta(minutes=4), 100, 100)     # the engine restarted
    _sample(replica, T0 + timedelta(minutes=8), 400, 400)
    # 500 + 100 + 300 of each kind; the window's ends alone (1000 → 400) would say 400 each.
    assert served_tokens("llama-3.1-8b", T0, T0 + timedelta(minutes=10)) == 2 * 900


@pytest.fixture
def priced_batch(catalog: Any, tenants: Any) -> Batch:
    """A replica at $12.29/h serving 2,000 tokens in the 10 minutes before a batch and 7,000
    during its 10 minutes, 1,400 of them the batch's."""
    deployment = Deployment.objects.create(name="chat", served_model_name="llama-3.1-8b",
                                           model=catalog["llama8b"])
    offer = Offer.objects.get(region=catalog["fra"], gpu_type=catalog["h100"])
    replica = Replica.objects.create(deployment=deployment, region=catalog["fra"], offer=offer,
                                     state="ready")
    Replica.objects.filter(pk=replica.pk).update(created_at=T0 - timedelta(hours=2),
                                                 state_changed_at=T0 - timedelta(hours=2))
    _sample(replica, T0 - timedelta(minutes=30), 0, 0)        # before both windows
    _sample(replica, T0 - timedelta(minutes=10), 500, 500)
    _sample(replica, T0, 1500, 1500)
    _sample(replica, T0 + timedelta(minutes=5), 3000, 3000)
    _sample(replica, T0 + timedelta(minutes=10), 5500, 4500)
    _sample(replica, T0 + timedelta(minutes=20), 9000, 9000)  # after the batch
    other = Deployment.objects.create(name="other", served_model_name="other-model",
                                      model=catalog["llama8b"])
    Replica.objects.create(deployment=other, region=catalog["fra"], offer=offer, state="ready")

    acme = tenants["acme"]
    source = BatchFile.objects.create(tenant=acme, purpose="batch", filename="in.jsonl",
                                      bytes=1, line_count=3, content=b"x")
    batch = Batch.objects.create(tenant=acme, input_file=source, endpoint="/v1/chat/completions",
                                 model="llama-3.1-8b", expires_at=T0 + timedelta(hours=24))
    for number, (state, usage) in enumerate([(LineState.DONE, 600), (LineState.DONE, 800),
                                             (LineState.FAILED, None)], start=1):
        BatchLine.objects.create(
            batch=batch, line_number=number, custom_id=f"l{number}", body={}, state=state,
            result={"usage": {"total_tokens": usage}} if usage else {"error": "x"})
    return batch


@pytest.mark.django_db
def test_a_batch_pays_its_token_share_of_its_window(priced_batch: Batch) -> None:
    not_started = batch_cost(priced_batch, now=T0)
    assert (not_started.tokens, not_started.usd, not_started.usd_per_mtok) == (1400, None, None)

    Batch.objects.filter(pk=priced_batch.pk).update(
        status="completed", in_progress_at=T0, completed_at=T0 + timedelta(minutes=10))
    priced_batch.refresh_from_db()
    cost = batch_cost(priced_batch, now=T0 + timedelta(hours=1))

    assert cost.window is not None and cost.interactive is not None
    assert cost.window.tokens == 7000 and cost.window.usd == FRA_H100 / 6
    assert cost.usd == FRA_H100 / 6 * 1400 / 7000
    assert cost.usd_per_mtok == pytest.approx(float(FRA_H100 / 6 / 7000 * 1_000_000), rel=1e-3)
    assert (cost.interactive.start, cost.interactive.end) == (T0 - timedelta(minutes=10), T0)
    assert cost.interactive.tokens == 2000
    assert cost.interactive_usd_per_mtok == pytest.approx(
        float(FRA_H100 / 6 / 2000 * 1_000_000), rel=1e-3)
    assert cost.ratio_vs_interactive == pytest.approx(2000 / 7000, abs=1e-3)


@pytest.mark.django_db
def test_tokens_the_counters_missed_are_floored_at_the_batchs_own(priced_batch: Batch) -> None:
    ReplicaSample.objects.all().delete()
    Batch.objects.filter(pk=priced_batch.pk).update(
        status="completed", in_progress_at=T0, completed_at=T0 + timedelta(minutes=10))
    priced_batch.refresh_from_db()
    cost = batch_cost(priced_batch, now=T0 + timedelta(hours=1))
    assert cost.usd == FRA_H100 / 6   # all of it: nothing else was seen served
    assert served_tokens("llama-3.1-8b", T0, T0 + timedelta(minutes=10)) == 0


@pytest.mark.django_db
def test_the_batch_api_answer_carries_the_cost_under_meridian(fleet: Any,
                                                              priced_batch: Batch) -> None:
    Batch.objects.filter(pk=priced_batch.pk).update(
        status="completed", in_progress_at=T0, completed_at=T0 + timedelta(minutes=10))
    answer = client(fleet["acme"]).get(f"/v1/batches/{priced_batch.pk}").json()
    assert answer["object"] == "batch" and answer["request_counts"]["completed"] == 2
    cost = answer["meridian"]["cost"]
    assert cost["tokens"] == 1400
    assert cost["usd"] == float((FRA_H100 / 6 / 5).quantize(Decimal("0.01")))  # to the cent
    assert cost["ratio_vs_interactive"] == pytest.approx(2000 / 7000, abs=1e-3)
    assert cost["window"]["tokens"] == 7000 and cost["interactive_window"]["tokens"] == 2000

    other = client(fleet["globex"]).get(f"/v1/batches/{priced_batch.pk}")
    assert other.status_code == 404   # another tenant sees neither the batch nor its cost


@pytest.mark.django_db
def test_the_window_usage_and_tokens_are_one_record_and_figures_are_rounded(
        fleet: Any, priced_batch: Batch) -> None:
    """A batch's window counted 0 tokens while cost.tokens said 960, its usage was null, and
    window.usd and ratio_vs_interactive came unrounded (0.012725637932777778)."""
    BatchLine.objects.filter(batch=priced_batch, custom_id="l1").update(result={"usage": {
        "prompt_tokens": 400, "completion_tokens": 200, "total_tokens": 600,
        "prompt_tokens_details": {"cached_tokens": 128}}})
    BatchLine.objects.filter(batch=priced_batch, custom_id="l2").update(result={"usage": {
        "prompt_tokens": 500, "completion_tokens": 300, "total_tokens": 800}})
    # The counters saw nothing of the batch's window: only the batch's own tokens are known.
    ReplicaSample.objects.filter(at__gt=T0).delete()
    Batch.objects.filter(pk=priced_batch.pk).update(
        status="completed", in_progress_at=T0, completed_at=T0 + timedelta(minutes=10))
    answer = client(fleet["acme"]).get(f"/v1/batches/{priced_batch.pk}").json()
    cost = answer["meridian"]["cost"]
    assert cost["tokens"] == 1400 and cost["window"]["tokens"] == 1400
    assert answer["usage"] == {
        "input_tokens": 900, "input_tokens_details": {"cached_tokens": 128},
        "output_tokens": 500, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 1400}
    # Money to the cent (four figures under one), ratios to three decimals, as everywhere.
    window_usd = FRA_H100 / 6
    assert cost["window"]["usd"] == float(window_usd.quantize(Decimal("0.01")))
    assert cost["usd"] == cost["window"]["usd"]  # all the window's tokens were the batch's
    # The same $ over 1,400 tokens against over the interactive window's 2,000.
    assert cost["ratio_vs_interactive"] == 1.429
