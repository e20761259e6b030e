"""A deployment no offer can ever hold is refused when it is created or changed: 400 naming
the field the rule binds on, in the solver's words, with the layout that fits where one
does; nothing is written."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from controlplane.core.models import AuditLog, Role
from controlplane.deployments.models import Deployment, Model
from regions.models import Jurisdiction, Offer

pytestmark = pytest.mark.django_db

# The README's example, as a user first sent it.
README_CHAT_EU = {
    "name": "chat-eu", "served_model_name": "llama-3.1-8b", "model": "llama-3.1-8b-instruct",
    "allowed_jurisdictions": ["EU"], "user_regions": ["aws:eu-central-1"],
    "min_replicas": 2, "max_replicas": 6, "spread_regions": 2, "max_model_len": 16384,
}


def _wide_nodes(catalog: dict[str, Any], gpus: int) -> None:
    """Nodes of `gpus` H100 in both EU regions, beside the catalog's one-GPU ones."""
    for region in (catalog["fra"], catalog["ams"]):
        Offer.objects.create(
            region=region, gpu_type=catalog["h100"], gpus_per_node=gpus,
            instance_type=f"h100x{gpus}", on_demand_usd_h=Decimal("12.29") * gpus,
            observed_at=datetime(2026, 11, 1, tzinfo=UTC))


def _nothing_written() -> None:
    assert not Deployment.objects.exists()
    assert not AuditLog.objects.filter(object_type="deployments.deployment").exists()


def test_the_readme_example_at_16k_tokens_is_refused_naming_the_fit(catalog, make_client):  # type: ignore[no-untyped-def]
    response = make_client(Role.OPERATOR).post("/api/v1/deployments/", README_CHAT_EU,
                                               format="json")
    assert response.status_code == 400, response.content
    # One-GPU nodes only: no larger TP fits a node, two pipeline stages over two nodes do.
    assert list(response.json()) == ["pipeline_parallel"], response.json()
    [words] = response.json()["pipeline_parallel"]
    assert "16,384 tokens × 32 sequences does not fit 1× H100 (tp 1)" in words
    assert words.endswith("; tp 1 × pp 2 fits")
    _nothing_written()


def test_where_a_larger_tp_fits_the_answer_names_the_smallest(catalog, make_client):  # type: ignore[no-untyped-def]
    _wide_nodes(catalog, 8)
    response = make_client(Role.OPERATOR).post("/api/v1/deployments/", README_CHAT_EU,
                                               format="json")
    assert response.status_code == 400, response.content
    [words] = response.json()["tensor_parallel"]
    assert "does not fit 1× H100 (tp 1)" in words and words.endswith("; tp 2 fits")
    _nothing_written()
    fixed = make_client(Role.OPERATOR).post(
        "/api/v1/deployments/", {**README_CHAT_EU, "tensor_parallel": 2}, format="json")
    assert fixed.status_code == 201, fixed.content
    assert fixed.json()["placement_status"] == "placeable"


def test_the_readme_example_at_8k_tokens_is_accepted(catalog, make_client):  # type: ignore[no-untyped-def]
    response = make_client(Role.OPERATOR).post(
        "/api/v1/deployments/", {**README_CHAT_EU, "max_model_len": 8192}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["placement_status"] == "placeable" and body["placement_problem"] == ""


def test_a_405b_model_at_tp_1_is_refused_with_the_layout_that_fits(catalog, make_client):  # type: ignore[no-untyped-def]
    Model.objects.create(name="llama-3.1-405b-instruct", hf_id="meta-llama/Llama-3.1-405B",
                         parameters_b=405, layers=126, attention_heads=128, kv_heads=8,
                         head_dim=128, max_context=131072)
    _wide_nodes(catalog, 8)
    body = {**README_CHAT_EU, "model": "llama-3.1-405b-instruct", "max_model_len": 8192,
            "min_replicas": 1, "spread_regions": 1}
    response = make_client(Role.OPERATOR).post("/api/v1/deployments/", body, format="json")
    assert response.status_code == 400, response.content
    [words] = response.json()["pipeline_parallel"]
    assert "does not fit" in words and words.endswith("; tp 8 × pp 2 fits")
    _nothing_written()


def test_a_jurisdiction_without_offers_is_refused_by_name(catalog, make_client):  # type: ignore[no-untyped-def]
    Jurisdiction.objects.create(code="UK", name="United Kingdom")
    body = {**README_CHAT_EU, "max_model_len": 8192, "allowed_jurisdictions": ["UK"],
            "user_regions": [], "spread_regions": 1}
    response = make_client(Role.OPERATOR).post("/api/v1/deployments/", body, format="json")
    assert response.status_code == 400, response.content
    [words] = response.json()["allowed_jurisdictions"]
    assert "no offer in UK" in words
    _nothing_written()


def test_a_spread_the_offers_cannot_give_is_refused(catalog, make_client):  # type: ignore[no-untyped-def]
    body = {**README_CHAT_EU, "max_model_len": 8192, "spread_regions": 3}
    response = make_client(Role.OPERATOR).post("/api/v1/deployments/", body, format="json")
    assert response.status_code == 400, response.content
    [words] = response.json()["spread_regions"]
    assert "needs 3 regions but only 2" in words
    _nothing_written()


def test_a_change_that_can_never_run_is_refused_and_nothing_changes(catalog, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR)
    created = client.post("/api/v1/deployments/", {**README_CHAT_EU, "max_model_len": 8192},
                          format="json")
    assert created.status_code == 201, created.content
    events = AuditLog.objects.count()
    response = client.patch("/api/v1/deployments/chat-eu/",
                            {"max_model_len": 16384, "max_replicas": 5}, format="json")
    assert response.status_code == 400, response.content
    assert "does not fit 1× H100" in response.json()["pipeline_parallel"][0]
    d = Deployment.objects.get(name="chat-eu")
    assert (d.max_model_len, d.max_replicas) == (8192, 6)
    assert AuditLog.objects.count() == events


def test_a_change_clears_a_placement_problem_found_with_the_old_settings(catalog, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR)
    assert client.post("/api/v1/deployments/", {**README_CHAT_EU, "max_model_len": 8192},
                       format="json").status_code == 201
    Deployment.objects.filter(name="chat-eu").update(placement_problem="quota")
    assert client.get("/api/v1/deployments/chat-eu/").json()["placement_status"] == \
        "unplaceable"
    response = client.patch("/api/v1/deployments/chat-eu/", {"max_replicas": 5},
                            format="json")
    assert response.status_code == 200, response.content
    assert response.json()["placement_status"] == "placeable"
