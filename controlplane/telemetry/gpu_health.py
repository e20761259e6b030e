"""When a GPU node is unhealthy: a pure rule over its GPUs' latest readings.

A node is unhealthy when any GPU has
- uncorrected (volatile) ECC errors — the driver retires the page only after a reset, and a
  process touching it dies;
- a critical XID event within the hold window (XIDs are events, not states: one "fell off the
  bus" must keep the node out for a while, not for one reading). XIDs that an application
  causes by itself (13 graphics engine exception, 31 memory page fault, 43 stopped processing,
  45 preemptive clean-up) are recorded but do not make a node unhealthy; every other code,
  including NVML's 999 "unknown", does;
- NVML answering "GPU is lost";
- a temperature above the limit. A GPU that was over the limit counts as hot until it is
  `recovery_margin_c` below it, so a GPU hovering at the limit does not flap the node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

APPLICATION_XIDS = frozenset({13, 31, 43, 45})
XID_NAMES = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapper failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    999: "unknown XID",
}
DEFAULT_TEMPERATURE_LIMIT_C = 85.0
DEFAULT_RECOVERY_MARGIN_C = 5.0


@dataclass(frozen=True)
class GpuState:
    index: int
    temperature_c: float | None = None
    ecc_uncorrected: int | None = None
    lost: bool = False


@dataclass(frozen=True)
class Verdict:
    healthy: bool
    reasons: tuple[str, ...]
    hot: frozenset[int]  # GPU indices counted as over temperature (feed back as hot_before)

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def is_critical_xid(xid: int) -> bool:
    return xid not in APPLICATION_XIDS


def xid_label(xid: int) -> str:
    name = XID_NAMES.get(xid)
    return f"XID {xid} ({name})" if name else f"XID {xid}"


def gpu_health(gpus: Sequence[GpuState], recent_xids: Iterable[tuple[int, int]], *,
               temperature_limit_c: float = DEFAULT_TEMPERATURE_LIMIT_C,
               recovery_margin_c: float = DEFAULT_RECOVERY_MARGIN_C,
               hot_before: frozenset[int] = frozenset()) -> Verdict:
    """The node's health from its GPUs now and the (GPU index, XID) events in the hold window."""
    reasons: list[str] = []
    hot: set[int] = set()
    for g in sorted(gpus, key=lambda g: g.index):
        if g.lost:
            reasons.append(f"gpu{g.index} is lost (NVML: GPU is lost)")
        if g.ecc_uncorrected is not None and g.ecc_uncorrected > 0:
            reasons.append(f"gpu{g.index} has {g.ecc_uncorrected} uncorrected ECC "
                           f"error{'s' if g.ecc_uncorrected != 1 else ''}")
        if g.temperature_c is not None:
            threshold = temperature_limit_c
            if g.index in hot_before:
                threshold = temperature_limit_c - recovery_margin_c
            if g.temperature_c > threshold:
                hot.add(g.index)
                if g.temperature_c > temperature_limit_c:
                    reasons.append(f"gpu{g.index} at {g.temperature_c:g} °C, above the "
                                   f"{temperature_limit_c:g} °C limit")
                else:
                    reasons.append(f"gpu{g.index} at {g.temperature_c:g} °C, not yet below "
                                   f"{threshold:g} °C after exceeding {temperature_limit_c:g} °C")
    critical: dict[int, list[int]] = {}
    for index, xid in recent_xids:
        if is_critical_xid(xid) and xid not in critical.setdefault(index, []):
            critical[index].append(xid)
    for index in sorted(critical):
        if critical[index]:
            labels = ", ".join(xid_label(x) for x in critical[index])
            reasons.append(f"gpu{index} reported {labels}")
    return Verdict(not reasons, tuple(reasons), frozenset(hot))
