"""The API marks stale only observations that were supposed to refresh: catalog list prices
and default quota are dated information, never stale, however old."""

from __future__ import annotations

from datetime import UTC, datetime

from controlplane.core.models import Role
from regions.models import Offer, Quota


def test_list_prices_are_never_stale_but_old_observations_are(make_client, catalog) -> None:  # type: ignore[no-untyped-def]
    listed, observed = Offer.objects.filter(region=catalog["fra"])[:2]
    long_ago = datetime(2025, 10, 1, tzinfo=UTC)
    Offer.objects.filter(pk=listed.pk).update(source="catalog:2025-10-01", observed_at=long_ago)
    Offer.objects.filter(pk=observed.pk).update(source="skypilot", observed_at=long_ago)
    Quota.objects.filter(region=catalog["fra"]).update(source="catalog:2025-10-01",
                                                       observed_at=long_ago)
    client = make_client(Role.VIEWER)
    offers = {o["id"]: o for o in client.get("/api/v1/offers/?page_size=100").json()["results"]}
    assert offers[listed.pk]["stale"] is False
    assert offers[observed.pk]["stale"] is True
    quotas = client.get("/api/v1/quotas/?page_size=100").json()["results"]
    assert quotas and not any(q["stale"] for q in quotas if q["region"] == "aws:eu-central-1")
