"""Loading the shipped GPU catalog and folding in fresh offer observations.

`load_catalog` is idempotent: rows are matched on their natural keys and only written
when a value differs, so a second run reports zero changes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, time
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from controlplane.core.services import record_audit
from regions.models import Cloud, GpuType, Jurisdiction, Offer, Quota, Region

CATALOG_PATH = Path(__file__).resolve().parent / "catalog" / "catalog.json"


class CatalogError(ValueError):
    """The catalog file is malformed; the message names the entry and field."""


@dataclass
class LoadReport:
    created: Counter[str] = field(default_factory=Counter)
    updated: Counter[str] = field(default_factory=Counter)
    unchanged: Counter[str] = field(default_factory=Counter)

    @property
    def changed(self) -> int:
        return sum(self.created.values()) + sum(self.updated.values())

    def count(self, kind: str, outcome: str) -> None:
        getattr(self, outcome)[kind] += 1

    def summary(self) -> str:
        kinds = sorted(set(self.created) | set(self.updated) | set(self.unchanged))
        parts = [
            f"{kind}: {self.created[kind]} created, {self.updated[kind]} updated, "
            f"{self.unchanged[kind]} unchanged"
            for kind in kinds
        ]
        return "; ".join(parts)


ModelT = TypeVar("ModelT", bound=models.Model)


def upsert(
    model: type[ModelT], lookup: dict[str, Any], values: dict[str, Any],
    report: LoadReport, kind: str,
) -> ModelT:
    """Create or update one row, writing only when a value differs."""
    row = model._default_manager.filter(**lookup).first()
    if row is None:
        row = model._default_manager.create(**lookup, **values)
        report.count(kind, "created")
        return row
    dirty = [name for name, value in values.items() if getattr(row, name) != value]
    if dirty:
        for name in dirty:
            setattr(row, name, values[name])
        row.save(update_fields=dirty)
        report.count(kind, "updated")
    else:
        report.count(kind, "unchanged")
    return row


def _require(entry: dict[str, Any], where: str, *names: str) -> None:
    missing = [name for name in names if entry.get(name) in (None, "")]
    if missing:
        raise CatalogError(f"{where}: missing field(s) {', '.join(missing)}")


def _money(value: Any, where: str) -> Decimal | None:
    if value is None:
        return None
    amount = Decimal(str(value)).quantize(Decimal("0.0001"))
    if amount < 0:
        raise CatalogError(f"{where}: price must not be negative, got {value}")
    return amount


def read_catalog(path: Path = CATALOG_PATH) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CatalogError(f"catalog file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise CatalogError(f"{path}: not valid JSON ({exc})") from None
    for key in ("as_of", "jurisdictions", "clouds", "regions", "gpu_types", "offers"):
        if key not in data:
            raise CatalogError(f"{path}: missing top-level key {key!r}")
    return data


def catalog_observed_at(data: dict[str, Any]) -> datetime:
    as_of = datetime.fromisoformat(data["as_of"]).date()
    return datetime.combine(as_of, time(0, 0), tzinfo=UTC)


@transaction.atomic
def load_catalog(data: dict[str, Any]) -> LoadReport:
    """Load clouds, jurisdictions, regions, GPU types, offers and quota limits; all or nothing."""
    report = LoadReport()
    observed_at = catalog_observed_at(data)
    source = f"catalog:{data['as_of']}"
    jurisdictions = _load_jurisdictions(data["jurisdictions"], report)
    clouds = _load_clouds(data["clouds"], report)
    regions = _load_regions(data["regions"], clouds, jurisdictions, report)
    gpus = _load_gpu_types(data["gpu_types"], report)
    for i, entry in enumerate(data["offers"]):
        where = f"offers[{i}]"
        _require(entry, where, "cloud", "region", "gpu", "gpus_per_node", "on_demand_usd_h")
        region, gpu = _region_and_gpu(regions, gpus, entry, where)
        on_demand = _money(entry["on_demand_usd_h"], where)
        spot = _money(entry.get("spot_usd_h"), where)
        if spot is not None and on_demand is not None and spot > on_demand:
            raise CatalogError(f"{where}: spot_usd_h {spot} is above on_demand_usd_h {on_demand}")
        upsert(
            Offer,
            {"region": region, "gpu_type": gpu, "gpus_per_node": int(entry["gpus_per_node"]),
             "instance_type": entry.get("instance_type", "")},
            {"on_demand_usd_h": on_demand, "spot_usd_h": spot, "source": source,
             "observed_at": observed_at},
            report, "offers",
        )
    for i, entry in enumerate(data.get("quotas", [])):
        where = f"quotas[{i}]"
        _require(entry, where, "cloud", "region", "gpu", "limit_gpus")
        region, gpu = _region_and_gpu(regions, gpus, entry, where)
        upsert(
            Quota, {"region": region, "gpu_type": gpu},
            {"limit_gpus": int(entry["limit_gpus"]), "source": source, "observed_at": observed_at},
            report, "quotas",
        )
    return report


def _load_jurisdictions(entries: list[dict[str, Any]], report: LoadReport
                        ) -> dict[str, Jurisdiction]:
    jurisdictions = {}
    for i, entry in enumerate(entries):
        _require(entry, f"jurisdictions[{i}]", "code", "name")
        jurisdictions[entry["code"]] = upsert(
            Jurisdiction, {"code": entry["code"]}, {"name": entry["name"]}, report, "jurisdictions"
        )
    return jurisdictions


def _load_clouds(entries: list[dict[str, Any]], report: LoadReport) -> dict[str, Cloud]:
    clouds = {}
    for i, entry in enumerate(entries):
        _require(entry, f"clouds[{i}]", "name", "display_name")
        clouds[entry["name"]] = upsert(
            Cloud, {"name": entry["name"]},
            {"display_name": entry["display_name"],
             "skypilot_name": entry.get("skypilot_name", "")},
            report, "clouds",
        )
    return clouds


def _load_regions(entries: list[dict[str, Any]], clouds: dict[str, Cloud],
                  jurisdictions: dict[str, Jurisdiction], report: LoadReport
                  ) -> dict[tuple[str, str], Region]:
    regions = {}
    for i, entry in enumerate(entries):
        where = f"regions[{i}]"
        _require(entry, where, "cloud", "code", "latitude", "longitude", "country", "jurisdiction")
        if entry["cloud"] not in clouds:
            raise CatalogError(f"{where}: unknown cloud {entry['cloud']!r}")
        if entry["jurisdiction"] not in jurisdictions:
            raise CatalogError(f"{where}: unknown jurisdiction {entry['jurisdiction']!r}")
        regions[(entry["cloud"], entry["code"])] = upsert(
            Region, {"cloud": clouds[entry["cloud"]], "code": entry["code"]},
            {
                "display_name": entry.get("display_name") or entry["code"],
                "latitude": float(entry["latitude"]),
                "longitude": float(entry["longitude"]),
                "country": entry["country"].upper(),
                "jurisdiction": jurisdictions[entry["jurisdiction"]],
            },
            report, "regions",
        )
    return regions


def _load_gpu_types(entries: list[dict[str, Any]], report: LoadReport) -> dict[str, GpuType]:
    gpus = {}
    for i, entry in enumerate(entries):
        _require(entry, f"gpu_types[{i}]", "name", "memory_gib", "memory_bandwidth_gbps")
        gpus[entry["name"]] = upsert(
            GpuType, {"name": entry["name"]},
            {
                "vendor": entry.get("vendor", "nvidia"),
                "memory_gib": int(entry["memory_gib"]),
                "memory_bandwidth_gbps": int(entry["memory_bandwidth_gbps"]),
                "bf16_tflops": float(entry.get("bf16_tflops", 0)),
                "fp16_tflops": float(entry.get("fp16_tflops", entry.get("bf16_tflops", 0))),
                "skypilot_name": entry.get("skypilot_name", entry["name"]),
            },
            report, "gpu_types",
        )
    return gpus


def _region_and_gpu(regions: dict[tuple[str, str], Region], gpus: dict[str, GpuType],
                    entry: dict[str, Any], where: str) -> tuple[Region, GpuType]:
    region = regions.get((entry["cloud"], entry["region"]))
    if region is None:
        raise CatalogError(f"{where}: unknown region {entry['cloud']}:{entry['region']}")
    gpu = gpus.get(entry["gpu"])
    if gpu is None:
        raise CatalogError(f"{where}: unknown GPU type {entry['gpu']!r}")
    return region, gpu


@dataclass(frozen=True)
class ObservedOffer:
    """A price seen by a provider just now; the provider layer converts to this shape."""

    cloud: str
    region: str
    gpu: str
    gpus_per_node: int
    instance_type: str
    on_demand_usd_h: float
    spot_usd_h: float | None
    source: str


@transaction.atomic
def apply_offer_observations(observations: Iterable[ObservedOffer]) -> LoadReport:
    """Fold fresh prices into known regions and GPU types; unknown ones are skipped."""
    report = LoadReport()
    now = timezone.now()
    regions = {(r.cloud.name, r.code): r for r in Region.objects.select_related("cloud")}
    gpus = {g.name: g for g in GpuType.objects.all()}
    for seen in observations:
        region = regions.get((seen.cloud, seen.region))
        gpu = gpus.get(seen.gpu)
        if region is None or gpu is None:
            report.count("skipped", "unchanged")
            continue
        on_demand = _money(seen.on_demand_usd_h, "observation")
        spot = _money(seen.spot_usd_h, "observation")
        if spot is not None and on_demand is not None and spot > on_demand:
            spot = None
        upsert(
            Offer,
            {"region": region, "gpu_type": gpu, "gpus_per_node": seen.gpus_per_node,
             "instance_type": seen.instance_type},
            {"on_demand_usd_h": on_demand, "spot_usd_h": spot, "source": seen.source,
             "observed_at": now},
            report, "offers",
        )
    return report


@dataclass
class RefreshReport:
    source: str
    ok: bool
    detail: str
    updated: int = 0
    stale_offers: int = 0


def refresh_offers(provider: Any, stale_after: Any = None) -> RefreshReport:
    """Ask a provider for current prices; on failure keep what we have and say how stale it is.

    `provider` is anything with `name` and `observe_offers()` (the Provider protocol).
    """
    stale_after = stale_after or settings.MERIDIAN["CATALOG_STALE_AFTER"]
    try:
        observations = provider.observe_offers()
    except Exception as exc:  # any provider failure leaves the catalog as it was
        stale = Offer.objects.filter(observed_at__lt=timezone.now() - stale_after).count()
        detail = f"{exc}; kept the stored offers ({stale} older than {stale_after} are stale)"
        record_audit(f"system:{provider.name}", "catalog.refresh_failed",
                     object_type="regions.offer", reason=detail)
        return RefreshReport(provider.name, False, detail, 0, stale)
    report = apply_offer_observations(
        ObservedOffer(o.cloud, o.region, o.gpu, o.gpus_per_node, o.instance_type,
                      o.on_demand_usd_h, o.spot_usd_h, o.source) for o in observations
    )
    changed = report.changed
    record_audit(f"system:{provider.name}", "catalog.refreshed", object_type="regions.offer",
                 changes={"observed": len(observations), "changed": changed},
                 reason=f"{len(observations)} offers observed")
    stale = Offer.objects.filter(observed_at__lt=timezone.now() - stale_after).count()
    return RefreshReport(provider.name, True, f"{len(observations)} observed, {changed} changed",
                         changed, stale)
