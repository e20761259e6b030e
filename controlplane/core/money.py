"""Money as Meridian shows it, in the API and on the dashboard alike: amounts to the cent
(under a cent, to four significant figures, never a zero that is not), $ per million tokens
to four significant figures, ratios to three decimals. Every figure of money a batch, the
costs API or a page gives goes through `amount`, `rate` or `ratio`. Pure."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

CENT = Decimal("0.01")
RATE_FIGURES = 4
RATIO_STEP = Decimal("0.001")


def cents(value: Decimal | float | int) -> Decimal:
    """An amount in dollars rounded to the cent (half up): 1982.995 -> 1983.00."""
    return Decimal(str(value)).quantize(CENT, rounding=ROUND_HALF_UP)


def rate(value: Decimal | float | int) -> float:
    """A $ per million tokens figure to four significant figures: 984.736… -> 984.7."""
    amount = Decimal(str(value))
    if amount == 0:
        return 0.0
    exponent = amount.adjusted() - (RATE_FIGURES - 1)
    return float(amount.quantize(Decimal(1).scaleb(exponent), rounding=ROUND_HALF_UP))


def amount(value: Decimal | float | int) -> Decimal:
    """An amount in dollars as shown: to the cent from a cent up (half up); under a cent, to
    four significant figures (a small batch's $0.003412), so that nothing spent reads $0."""
    figure = Decimal(str(value))
    if figure == 0 or abs(figure) >= CENT:
        return cents(figure)
    return Decimal(str(rate(figure)))


def ratio(value: Decimal | float | int | None) -> float | None:
    """A ratio or a fraction (batch $/Mtok ÷ interactive, spent ÷ budget) to three decimals,
    half up: 0.28571… -> 0.286."""
    if value is None:
        return None
    return float(Decimal(str(value)).quantize(RATIO_STEP, rounding=ROUND_HALF_UP))


def format_ratio(value: Decimal | float | int | None) -> str:
    """0.286×, or <0.001× for one too small to show rather than a zero it is not."""
    figure = ratio(value)
    if figure is None:
        return "—"
    if figure == 0 and value:
        return "<0.001×"
    return f"{figure:,.3f}×"


def format_usd(value: Decimal | float | int | None, *, per_mtok: bool = False) -> str:
    """$1,983.00, −$12.29, $0.003412 (under a cent), $984.7 (a rate), or a dash when there
    is no figure."""
    if value is None or value == "":
        return "—"
    if per_mtok:
        figure = Decimal(str(rate(value)))
        places = max(RATE_FIGURES - 1 - figure.adjusted(), 0) if figure else 2
        text = f"{abs(figure):,.{places}f}"
    else:
        figure = amount(value)
        places = max(2, -figure.as_tuple().exponent)  # type: ignore[operator]
        text = f"{abs(figure):,.{places}f}"
    return f"{'−' if figure < 0 else ''}${text}"
