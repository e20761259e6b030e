"""A new batch-tier deployment may run on spot unless told otherwise (its lines survive a
reclaimed replica); an interactive one may not unless asked. The solver then takes spot
where it is cheaper."""

from __future__ import annotations

import pytest

from controlplane.core.models import Role
from controlplane.deployments.models import Deployment
from controlplane.placement.proposals import deployment_request

pytestmark = pytest.mark.django_db

CHAT = {
    "name": "nightly", "served_model_name": "llama-3.1-8b", "model": "llama-3.1-8b-instruct",
    "allowed_jurisdictions": ["EU"], "user_regions": ["aws:eu-central-1"],
    "min_replicas": 0, "max_replicas": 2, "max_model_len": 8192,
}


def create(make_client, **fields):  # type: ignore[no-untyped-def]
    return make_client(Role.OPERATOR).post("/api/v1/deployments/", {**CHAT, **fields},
                                           format="json")


def test_a_batch_tier_deployment_defaults_to_spot(catalog, make_client) -> None:  # type: ignore[no-untyped-def]
    response = create(make_client, tier="batch")
    assert response.status_code == 201, response.json()
    assert response.json()["max_spot_fraction"] == 1.0
    assert deployment_request(Deployment.objects.get(name="nightly")).max_spot_fraction == 1.0


def test_what_is_asked_for_wins_and_interactive_stays_on_demand(catalog, make_client) -> None:  # type: ignore[no-untyped-def]
    assert create(make_client, tier="batch", max_spot_fraction=0.25).json()[
        "max_spot_fraction"] == 0.25
    response = create(make_client, name="chat", tier="interactive", min_replicas=1)
    assert response.status_code == 201 and response.json()["max_spot_fraction"] == 0.0
    # A later update of a batch deployment keeps what it has unless it names the field.
    batch = Deployment.objects.get(name="nightly")
    updated = make_client(Role.OPERATOR).patch(f"/api/v1/deployments/{batch.pk}/",
                                               {"max_replicas": 3}, format="json")
    assert updated.status_code == 200 and updated.json()["max_spot_fraction"] == 0.25


def test_a_bad_spot_share_is_refused_naming_it_and_nothing_is_stored(catalog, make_client) -> None:  # type: ignore[no-untyped-def]
    response = create(make_client, tier="batch", max_spot_fraction=2)
    assert response.status_code == 400 and "max_spot_fraction" in response.json()
    assert not Deployment.objects.exists()
