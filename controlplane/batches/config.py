"""The batch settings' reader: a numeric `BATCH_*` Django setting, or its default where
unset."""

from __future__ import annotations

from django.conf import settings


def number(name: str, default: float) -> float:
    """`settings.<name>` as a number, or `default` where the deployment does not set it."""
    return float(getattr(settings, name, default))
