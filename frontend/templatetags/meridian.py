"""Template tags of the dashboard: figures, money, states and times shown the same everywhere."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from django import template
from django.utils import timezone
from django.utils.html import format_html, format_html_join, json_script
from django.utils.safestring import SafeString

from controlplane.core.money import format_ratio, format_usd
from controlplane.core.redaction import redact_addresses

register = template.Library()


@register.simple_tag
def figure(fig: dict[str, Any], element_id: str, label: str = "") -> SafeString:
    """A plotly figure: an empty element that meridian.js draws from the embedded JSON."""
    return format_html(
        '<div class="figure" id="{}" data-figure="{}-data" role="img" aria-label="{}"></div>{}',
        element_id, element_id, label or element_id, json_script(fig, f"{element_id}-data"),
    )


@register.filter
def usd(value: Decimal | float | None) -> str:
    """$1,234.56, −$12.29, $0.003412 under a cent (or a dash when there is no figure), as
    the API rounds it."""
    return format_usd(value)


@register.filter
def usd_fine(value: Decimal | float | None) -> str:
    """Money that may be less than a cent (a batch's cost): as `usd`, which gives one under
    a cent to four significant figures ($0.003412)."""
    return format_usd(value)


@register.filter
def usd_per_mtok(value: Decimal | float | None) -> str:
    """$ per million tokens to four significant figures, as the API: $984.7, $0.2135."""
    return format_usd(value, per_mtok=True)


@register.filter
def number(value: float | int | None, places: int = 0) -> str:
    if value is None:
        return "—"
    return f"{value:,.{int(places)}f}"


@register.filter
def ratio(value: float | None) -> str:
    """A ratio to three decimals, as the API gives it: "0.425×"; one under 0.001 as
    "<0.001×" rather than a zero it is not."""
    return format_ratio(value)


@register.filter
def percent(value: float | None, digits: int = 0) -> str:
    """A fraction in [0, 1] as a percentage, with `digits` decimals."""
    if value is None:
        return "—"
    return f"{100 * value:.{int(digits)}f}%"


@register.filter
def ago(value: datetime | None) -> str:
    """How long ago, in the largest unit that fits: 40 s, 12 min, 3 h, 9 d."""
    if value is None:
        return "never"
    seconds = max((timezone.now() - value).total_seconds(), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return f"{int(seconds)} s ago"


@register.filter
def duration(seconds: float | None) -> str:
    """A time span to come, in its two largest units: 40 s, 12 min, 3 h 20 min, 2 d 4 h;
    a dash when it is not known."""
    if seconds is None:
        return "—"
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds} s"
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size or parts:
            parts.append(f"{seconds // size} {unit}")
            seconds %= size
        if len(parts) == 2:
            break
    return " ".join(p for p in parts if not p.startswith("0 ")) or "0 min"


@register.filter
def badge(value: str, kind: str = "state") -> SafeString:
    """A coloured label for a replica state, region health, plan status …"""
    return format_html('<span class="badge {}-{}">{}</span>', kind, value, value)


@register.filter
def get(mapping: dict[str, Any], key: str) -> Any:
    return mapping.get(key) if mapping else None


@register.filter
def words(value: str) -> str:
    """snake_case names as words: offers_considered → offers considered."""
    return str(value).replace("_", " ")


@register.filter
def counts(states: dict[str, int], kind: str = "state") -> SafeString:
    """Counts by state as badges that carry their numbers: “3 ready”, “1 failed”."""
    return format_html_join(" ", '<span class="badge {}-{}">{} {}</span>',
                            ((kind, state, n, state) for state, n in (states or {}).items()))


@register.filter
def no_addresses(text: str) -> str:
    """Text with every URL and IP address hidden: what tenant users see of platform errors."""
    return redact_addresses(str(text or ""))
