"""Money as Meridian shows it, in the API and on the dashboard alike: amounts to the cent,
$ per million tokens to four significant figures. Pure."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

CENT = Decimal("0.01")
RATE_FIGURES = 4


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


def format_usd(value: Decimal | float | int | None, *, per_mtok: bool = False) -> str:
    """$1,983.00, −$12.29, $984.7 (a rate), or a dash when there is no figure."""
    if value is None or value == "":
        return "—"
    if per_mtok:
        figure = Decimal(str(rate(value)))
        places = max(RATE_FIGURES - 1 - figure.adjusted(), 0) if figure else 2
        text = f"{abs(figure):,.{places}f}"
    else:
        figure = cents(value)
        text = f"{abs(figure):,.2f}"
    return f"{'−' if figure < 0 else ''}${text}"
