"""How many lines a batch sends at once (AIMD): halved under pressure, one more otherwise,
within its bounds. Table-driven: (current, what the round met, expected, why)."""

from __future__ import annotations

import pytest

from controlplane.batches.concurrency import (
    Limits,
    Pressure,
    lower_baseline,
    next_concurrency,
)

LIMITS = Limits(floor=1, ceiling=16)

CASES = [
    (8, Pressure(sent=8), 9, "a full round with no pressure grows by one"),
    (8, Pressure(sent=3), 8, "a round with fewer lines than allowed learns nothing"),
    (16, Pressure(sent=16), 16, "never past the ceiling"),
    (8, Pressure(sent=8, refused=1), 4, "one answer at capacity halves it"),
    (1, Pressure(sent=1, refused=1), 1, "never under the floor"),
    (9, Pressure(sent=9, waiting=4), 4, "a target replica's queue at the limit halves it"),
    (9, Pressure(sent=9, waiting=3.5), 10, "a queue under the limit does not"),
    (8, Pressure(sent=8, kv_usage=0.95), 4, "a KV cache nearly full halves it"),
    (8, Pressure(sent=8, ttft_p95_s=0.5, ttft_baseline_s=0.3), 4,
     "TTFT over 1.2x its baseline halves it"),
    (8, Pressure(sent=8, ttft_p95_s=0.35, ttft_baseline_s=0.3), 9,
     "TTFT within 1.2x does not"),
    (8, Pressure(sent=8, ttft_p95_s=0.15, ttft_baseline_s=0.05), 9,
     "a fast TTFT that tripled is still under the floor worth acting on"),
    (8, Pressure(sent=8, ttft_p95_s=0.5, ttft_baseline_s=None), 9,
     "no baseline yet: TTFT alone says nothing"),
]


@pytest.mark.parametrize(("current", "pressure", "expected", "why"), CASES,
                         ids=[case[3] for case in CASES])
def test_next_concurrency(current: int, pressure: Pressure, expected: int, why: str) -> None:
    assert next_concurrency(current, pressure, LIMITS)[0] == expected, why


def test_the_reason_for_backing_off_names_the_signal() -> None:
    assert next_concurrency(8, Pressure(sent=8, refused=2), LIMITS)[1] == \
        "2 of 8 sends refused (at capacity)"
    assert "KV cache 95% full" in next_concurrency(8, Pressure(sent=8, kv_usage=0.95),
                                                   LIMITS)[1]
    assert "TTFT p95 500 ms" in next_concurrency(
        8, Pressure(sent=8, ttft_p95_s=0.5, ttft_baseline_s=0.3), LIMITS)[1]
    assert next_concurrency(8, Pressure(sent=8), LIMITS)[1] == ""


def test_a_batch_gives_capacity_back_at_once_and_takes_it_slowly() -> None:
    n = 16
    n, _ = next_concurrency(n, Pressure(sent=n, refused=n), LIMITS)
    n, _ = next_concurrency(n, Pressure(sent=n, refused=1), LIMITS)
    assert n == 4
    for _ in range(3):
        n, _ = next_concurrency(n, Pressure(sent=n), LIMITS)
    assert n == 7


def test_the_ttft_baseline_is_the_lowest_reading() -> None:
    assert lower_baseline(None, None) is None
    assert lower_baseline(None, 0.4) == 0.4
    assert lower_baseline(0.4, 0.3) == 0.3
    assert lower_baseline(0.3, 0.9) == 0.3
    assert lower_baseline(0.3, 0.0) == 0.3
