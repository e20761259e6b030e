"""Lab regions for the local provider: where each is, the network namespace it may run in
(`MERIDIAN_LAB_NETNS`), and the one-way delay between two of them that the relays add."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from regions.geo import great_circle_km, one_way_ms

# Added to every one-way delay: a relay hop and a router or two even between neighbours.
FIXED_ONE_WAY_MS = 0.25


def one_way_delay_ms(a: tuple[float, float], b: tuple[float, float],
                     fixed_ms: float = FIXED_ONE_WAY_MS) -> float:
    """Fibre delay over the great circle between two (lat, lon) points, plus a fixed cost."""
    return round(one_way_ms(great_circle_km(a[0], a[1], b[0], b[1])) + fixed_ms, 3)


@dataclass(frozen=True)
class RegionNamespace:
    """The network namespace a lab region's processes run in, and its address there."""

    name: str
    address: str


def parse_netns(text: str, variable: str = "MERIDIAN_LAB_NETNS") -> dict[str, RegionNamespace]:
    """`local:eu-frankfurt=mrdnet-1-0@10.213.0.2,...` → region → namespace; ValueError naming
    `variable` and the entry when one is malformed."""
    out: dict[str, RegionNamespace] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        region, _, rest = entry.partition("=")
        name, _, address = rest.partition("@")
        if not region or not name or not address or any(c.isspace() for c in entry):
            raise ValueError(f"{variable}: {entry!r} is not REGION=NAMESPACE@ADDRESS, e.g. "
                             "local:eu-frankfurt=mrdnet-1-0@10.213.0.2")
        out[region] = RegionNamespace(name, address)
    return out


@dataclass(frozen=True)
class LabRegion:
    code: str  # as the control plane names it, e.g. "local:eu-frankfurt" (or bare)
    latitude: float
    longitude: float
    price_usd_h: float | None = None

    @classmethod
    def of(cls, value: LabRegion | Mapping[str, Any]) -> LabRegion:
        if isinstance(value, LabRegion):
            return value
        price = value.get("price_usd_h")
        return cls(str(value["code"]), float(value["latitude"]), float(value["longitude"]),
                   float(price) if price is not None else None)

    @property
    def bare_code(self) -> str:
        return self.code.split(":", 1)[1] if ":" in self.code else self.code
