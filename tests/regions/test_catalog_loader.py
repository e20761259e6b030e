"""Loading the catalog: idempotent, all-or-nothing, and errors that name the entry."""

from __future__ import annotations

import copy
import re
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command

from regions.models import Offer, Quota, Region
from regions.services import (
    CATALOG_PATH,
    CatalogError,
    ObservedOffer,
    apply_offer_observations,
    load_catalog,
    read_catalog,
)

pytestmark = pytest.mark.django_db

SMALL: dict[str, Any] = {
    "as_of": "2026-10-01",
    "sources": [],
    "jurisdictions": [{"code": "EU", "name": "European Union"}],
    "clouds": [{"name": "aws", "display_name": "AWS", "skypilot_name": "aws"}],
    "regions": [{"cloud": "aws", "code": "eu-central-1", "display_name": "Frankfurt",
                 "latitude": 50.1, "longitude": 8.7, "country": "DE", "jurisdiction": "EU"}],
    "gpu_types": [{"name": "H100", "memory_gib": 80, "memory_bandwidth_gbps": 3350,
                   "bf16_tflops": 989}],
    "offers": [{"cloud": "aws", "region": "eu-central-1", "gpu": "H100", "gpus_per_node": 8,
                "instance_type": "p5.48xlarge", "on_demand_usd_h": 98.32, "spot_usd_h": 40.1}],
    "quotas": [{"cloud": "aws", "region": "eu-central-1", "gpu": "H100", "limit_gpus": 64}],
}


def test_second_load_changes_nothing():
    first = load_catalog(copy.deepcopy(SMALL))
    assert first.changed == 6
    second = load_catalog(copy.deepcopy(SMALL))
    assert second.changed == 0
    assert sum(second.unchanged.values()) == 6


def test_reload_keeps_quota_in_use_and_updates_prices():
    load_catalog(copy.deepcopy(SMALL))
    Quota.objects.update(in_use_gpus=16)
    changed = copy.deepcopy(SMALL)
    changed["offers"][0]["on_demand_usd_h"] = 90.0
    report = load_catalog(changed)
    assert report.updated["offers"] == 1
    assert Quota.objects.get().in_use_gpus == 16
    assert str(Offer.objects.get().on_demand_usd_h) == "90.0000"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["regions"][0].update(jurisdiction="XX"), "regions[0]: unknown jurisdiction 'XX'"),
        (lambda c: c["offers"][0].update(gpu="Z1"), "offers[0]: unknown GPU type 'Z1'"),
        (lambda c: c["offers"][0].update(spot_usd_h=200), "offers[0]: spot_usd_h 200.0000 is above"),
        (lambda c: c["offers"][0].pop("gpus_per_node"), "offers[0]: missing field(s) gpus_per_node"),
        (lambda c: c["quotas"][0].update(region="mars-1"), "quotas[0]: unknown region aws:mars-1"),
    ],
)
def test_malformed_entry_aborts_the_whole_load(mutate, message):
    bad = copy.deepcopy(SMALL)
    mutate(bad)
    with pytest.raises(CatalogError, match=re.escape(message)):
        load_catalog(bad)
    assert not Region.objects.exists()


def test_observations_update_known_offers_and_skip_unknown():
    load_catalog(copy.deepcopy(SMALL))
    report = apply_offer_observations([
        ObservedOffer("aws", "eu-central-1", "H100", 8, "p5.48xlarge", 95.0, 35.0, "skypilot"),
        ObservedOffer("aws", "xx-nowhere-1", "H100", 8, "p5.48xlarge", 1.0, None, "skypilot"),
    ])
    assert report.updated["offers"] == 1
    assert report.unchanged["skipped"] == 1
    offer = Offer.objects.get()
    assert offer.source == "skypilot"
    assert str(offer.spot_usd_h) == "35.0000"


@pytest.mark.skipif(not CATALOG_PATH.exists(), reason="shipped catalog not present")
def test_shipped_catalog_seeds_and_reseeds_without_change():
    out = StringIO()
    call_command("seed_catalog", stdout=out)
    data = read_catalog()
    assert Region.objects.count() == len(data["regions"]) >= 40
    assert Offer.objects.count() == len(data["offers"])
    again = StringIO()
    call_command("seed_catalog", stdout=again)
    assert again.getvalue().strip().endswith("0 row(s) changed"), again.getvalue()


class CatalogSource:
    """The cloud price catalog boundary: answers with observations, or fails."""

    name = "skypilot"

    def __init__(self, observations=None, error=None):  # type: ignore[no-untyped-def]
        self.observations, self.error = observations or [], error

    def observe_offers(self):  # type: ignore[no-untyped-def]
        if self.error:
            raise self.error
        return self.observations


def test_refresh_folds_in_prices_and_marks_nothing_stale():
    from controlplane.provisioning.base import OfferObservation
    from regions.services import refresh_offers

    load_catalog(copy.deepcopy(SMALL))
    seen = OfferObservation("aws", "eu-central-1", "H100", 8, "p5.48xlarge", 60.0, 25.0, "skypilot")
    report = refresh_offers(CatalogSource([seen]))
    assert report.ok and report.updated == 1 and report.stale_offers == 0
    assert str(Offer.objects.get().on_demand_usd_h) == "60.0000"


def test_unreachable_catalog_keeps_data_and_reports_stale():
    from controlplane.core.models import AuditLog
    from controlplane.provisioning.base import ProviderError
    from regions.services import refresh_offers

    load_catalog(copy.deepcopy(SMALL))
    report = refresh_offers(CatalogSource(error=ProviderError("unavailable", "catalog offline")))
    assert not report.ok and report.stale_offers == 1
    assert "catalog offline" in report.detail
    assert str(Offer.objects.get().on_demand_usd_h) == "98.3200"
    assert AuditLog.objects.filter(action="catalog.refresh_failed").exists()
