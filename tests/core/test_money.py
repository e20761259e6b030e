"""Money is rounded one way everywhere: to the cent, and $/Mtok to four significant figures."""

from __future__ import annotations

from decimal import Decimal

import pytest

from controlplane.core.money import cents, format_usd, rate
from controlplane.costs.services import usd_per_mtok


@pytest.mark.parametrize(("value", "expected"), [
    (Decimal("1982.995"), Decimal("1983.00")), (2.765, Decimal("2.77")), (0, Decimal("0.00")),
    (Decimal("-0.005"), Decimal("-0.01")), (1e-7, Decimal("0.00")),
])
def test_amounts_round_half_up_to_the_cent(value, expected) -> None:  # type: ignore[no-untyped-def]
    assert cents(value) == expected


@pytest.mark.parametrize(("value", "expected"), [
    (984.736040609137, 984.7), (0.000123456, 0.0001235), (12_345.6, 12_350.0), (0, 0.0),
    (3.5, 3.5),
])
def test_rates_keep_four_significant_figures(value, expected) -> None:  # type: ignore[no-untyped-def]
    assert rate(value) == expected


def test_dollars_per_million_tokens_from_spend_and_tokens_are_rounded() -> None:
    assert usd_per_mtok(Decimal("1.9395"), 1_970) == 984.5
    assert usd_per_mtok(Decimal(1), 0) is None


def test_formatting_uses_the_same_rounding() -> None:
    assert format_usd(Decimal("1982.995")) == "$1,983.00"
    assert format_usd(984.736040609137, per_mtok=True) == "$984.7"
    assert format_usd(None) == "—"
