"""The GPU health rule, case by case."""

from __future__ import annotations

import pytest

from controlplane.telemetry.gpu_health import GpuState, gpu_health, is_critical_xid

LIMIT = 85.0


@pytest.mark.parametrize(("gpus", "xids", "hot_before", "healthy", "words"), [
    ([GpuState(0, 45, 0), GpuState(1, 60, 0)], [], set(), True, []),
    ([GpuState(0, 45, None)], [], set(), True, []),  # ECC off or unsupported: no verdict on it
    ([GpuState(0, 45, 1)], [], set(), False, ["gpu0 has 1 uncorrected ECC error"]),
    ([GpuState(0, 45, 0), GpuState(1, 45, 3)], [], set(), False, ["gpu1 has 3 uncorrected"]),
    ([GpuState(0, 85, 0)], [], set(), True, []),  # at the limit is not above it
    ([GpuState(0, 85.5, 0)], [], set(), False, ["gpu0 at 85.5 °C, above the 85 °C limit"]),
    ([GpuState(0, 82, 0)], [], {0}, False, ["not yet below 80 °C"]),  # hysteresis
    ([GpuState(0, 79, 0)], [], {0}, True, []),
    ([GpuState(0, 82, 0)], [], {1}, True, []),  # another GPU was hot
    ([GpuState(0, 40, 0)], [(0, 79)], set(), False, ["gpu0 reported XID 79 (GPU has fallen off"]),
    ([GpuState(0, 40, 0)], [(0, 48), (0, 48)], set(), False, ["XID 48 (double-bit ECC error)"]),
    ([GpuState(0, 40, 0)], [(0, 13), (0, 31), (0, 43), (0, 45)], set(), True, []),  # app XIDs
    ([GpuState(0, 40, 0)], [(0, 999)], set(), False, ["XID 999 (unknown XID)"]),
    ([GpuState(0, None, None, lost=True)], [], set(), False, ["gpu0 is lost"]),
])
def test_health_rule(gpus, xids, hot_before, healthy, words):  # type: ignore[no-untyped-def]
    verdict = gpu_health(gpus, xids, temperature_limit_c=LIMIT, hot_before=frozenset(hot_before))
    assert verdict.healthy is healthy, verdict.reasons
    for word in words:
        assert word in verdict.reason
    assert bool(verdict.reasons) is not healthy


def test_every_cause_is_named_and_hot_gpus_are_returned():  # type: ignore[no-untyped-def]
    verdict = gpu_health([GpuState(0, 90, 2), GpuState(1, 40, 0), GpuState(2, 88, 0)],
                         [(1, 74), (1, 13)], temperature_limit_c=LIMIT)
    assert not verdict.healthy
    assert verdict.hot == frozenset({0, 2})
    assert verdict.reasons == (
        "gpu0 has 2 uncorrected ECC errors",
        "gpu0 at 90 °C, above the 85 °C limit",
        "gpu2 at 88 °C, above the 85 °C limit",
        "gpu1 reported XID 74 (NVLink error)",
    )


def test_application_xids_are_not_critical():  # type: ignore[no-untyped-def]
    assert not any(is_critical_xid(x) for x in (13, 31, 43, 45))
    assert all(is_critical_xid(x) for x in (48, 63, 64, 74, 79, 92, 94, 95, 119, 999))
