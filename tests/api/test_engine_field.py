"""A deployment names its engine: vllm anywhere, enginesim (the simulator) only in the lab's
local regions. An enginesim deployment where placement has no local region is refused
naming `engine`, and the solver never places one outside local regions."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from controlplane.core.models import Role
from controlplane.deployments.models import Deployment
from controlplane.placement.problem import offer_allowed
from controlplane.placement.proposals import deployment_request, offer_options
from regions.models import Cloud, Jurisdiction, Offer, Region

pytestmark = pytest.mark.django_db

CHAT = {
    "name": "chat-eu", "served_model_name": "llama-3.1-8b", "model": "llama-3.1-8b-instruct",
    "allowed_jurisdictions": ["EU"], "user_regions": ["aws:eu-central-1"],
    "min_replicas": 1, "max_replicas": 2, "max_model_len": 8192,
}


def test_a_new_deployment_runs_vllm_unless_it_names_enginesim(catalog, make_client) -> None:  # type: ignore[no-untyped-def]
    response = make_client(Role.OPERATOR).post("/api/v1/deployments/", CHAT, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["engine"] == "vllm"


def test_enginesim_with_no_local_region_is_refused_naming_engine(catalog, make_client) -> None:  # type: ignore[no-untyped-def]
    response = make_client(Role.OPERATOR).post("/api/v1/deployments/",
                                               {**CHAT, "engine": "enginesim"}, format="json")
    assert response.status_code == 400
    assert "engine" in response.json() and "local" in str(response.json()["engine"])
    assert not Deployment.objects.exists()
    response = make_client(Role.OPERATOR).post("/api/v1/deployments/",
                                               {**CHAT, "engine": "tgi"}, format="json")
    assert response.status_code == 400 and "engine" in response.json()


def test_enginesim_is_placed_only_in_local_regions(catalog, make_client) -> None:  # type: ignore[no-untyped-def]
    local = Cloud.objects.create(name="local", display_name="Local lab")
    lab = Region.objects.create(cloud=local, code="eu-frankfurt", display_name="Lab",
                                latitude=50.1, longitude=8.7, country="DE",
                                jurisdiction=Jurisdiction.objects.get(code="EU"))
    Offer.objects.create(region=lab, gpu_type=catalog["h100"], gpus_per_node=1,
                         instance_type="enginesim", on_demand_usd_h=Decimal("20"),
                         observed_at=datetime(2026, 11, 1, tzinfo=UTC))
    response = make_client(Role.OPERATOR).post(
        "/api/v1/deployments/", {**CHAT, "engine": "enginesim"}, format="json")
    assert response.status_code == 201, response.json()
    request = deployment_request(Deployment.objects.get(name="chat-eu"))
    allowed = {o.region for o in offer_options() if offer_allowed(request, o)}
    assert allowed == {"local:eu-frankfurt"}  # the cheaper aws and gcp offers are not its
