"""Money is rounded one way everywhere: to the cent, and $/Mtok to four significant figures."""

from __future__ import annotations

from decimal import Decimal

import pytest

from controlplane.core.money import amount, cents, format_ratio, format_usd, rate, ratio
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


@pytest.mark.parametrize(("value", "expected"), [
    (Decimal("1982.995"), Decimal("1983.00")), (0.012725637932777778, Decimal("0.01")),
    (0.003412345, Decimal("0.003412")), (0, Decimal("0.00")), (Decimal("-0.0049999"),
                                                               Decimal("-0.005000")),
])
def test_amounts_keep_the_cent_and_four_figures_under_it(value, expected) -> None:  # type: ignore[no-untyped-def]
    assert amount(value) == expected


def test_ratios_keep_three_decimals_and_formatting_follows() -> None:
    assert ratio(0.012725637932777778) == 0.013 and ratio(2000 / 7000) == 0.286
    assert ratio(None) is None
    assert (format_ratio(0.4249), format_ratio(0.0004), format_ratio(None)) == (
        "0.425×", "<0.001×", "—")
    # A page shows the figure the API gives: under a cent as four figures, not $0.00.
    assert (format_usd(0.003412345), format_usd(0.5), format_usd(12.289)) == (
        "$0.003412", "$0.50", "$12.29")
