"""Typed readers of the environment that fail loudly, naming the variable at fault."""

from __future__ import annotations

import math
import os
from urllib.parse import unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.core.validators import URLValidator

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str | None = None) -> str:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ImproperlyConfigured(f"{name} must be set")
        return default
    return value


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be one of 1/0/true/false/yes/no/on/off, got {value!r}")


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {value!r}") from None


def env_float(name: str, default: float, above: float | None = None,
              at_most: float | None = None) -> float:
    """A number; `above` and `at_most` bound it (exclusive below, inclusive above)."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    low = -math.inf if above is None else above
    high = math.inf if at_most is None else at_most
    if not low < number <= high:
        if above is None and at_most is None:
            raise ImproperlyConfigured(f"{name} must be a number, got {value!r}")
        raise ImproperlyConfigured(f"{name} must be a number in ({low:g}, {high:g}], got {value!r}")
    return number


def env_url(name: str, schemes: tuple[str, ...] = ("http", "https")) -> str | None:
    """A URL with one of `schemes`; None when unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        URLValidator(schemes=list(schemes))(value)
    except ValidationError:
        raise ImproperlyConfigured(
            f"{name} must be an {'/'.join(schemes)} URL, got {value!r}") from None
    return value


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, default).strip()
    if value not in choices:
        raise ImproperlyConfigured(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def database_from_url(name: str, url: str) -> dict[str, object]:
    """Django DATABASES entry from a postgres:// URL; only Postgres is accepted."""
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql"}:
        raise ImproperlyConfigured(
            f"{name} must be a postgres:// or postgresql:// URL, got scheme {parts.scheme!r}"
        )
    db_name = unquote(parts.path.lstrip("/"))
    if not db_name:
        raise ImproperlyConfigured(f"{name} must name a database, e.g. postgresql://host/meridian")
    query = dict(item.split("=", 1) for item in parts.query.split("&") if "=" in item)
    host = unquote(parts.hostname or "") or query.pop("host", "")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": db_name,
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": host,
        "PORT": str(parts.port or ""),
        "CONN_MAX_AGE": 60,
        "CONN_HEALTH_CHECKS": True,
        "OPTIONS": query,
    }
