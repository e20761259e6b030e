"""Great-circle distance between regions and the network round trip it implies. Pure."""

from __future__ import annotations

import math

EARTH_RADIUS_KM = 6371.0088
# Light in fibre covers a kilometre in about 4.9 µs; routes are not great circles and
# routers add a little, hence the fixed cost per round trip.
FIBRE_US_PER_KM = 4.9
FIXED_RTT_MS = 0.5


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Haversine distance in kilometres."""
    phi1, phi2 = math.radians(lat1), math.radians(lat2)
    dphi = phi2 - phi1
    dlmb = math.radians(lon2 - lon1)
    a = math.sin(dphi / 2) ** 2 + math.cos(phi1) * math.cos(phi2) * math.sin(dlmb / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(a)))


def one_way_ms(km: float) -> float:
    return km * FIBRE_US_PER_KM / 1000.0


def rtt_ms(km: float) -> float:
    """Round-trip time over `km` of fibre, plus the fixed cost."""
    return 2 * one_way_ms(km) + FIXED_RTT_MS
