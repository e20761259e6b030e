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


def env_int(name: str, default: int, at_least: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {value!r}") from None
    if at_least is not None and number < at_least:
        raise ImproperlyConfigured(f"{name} must be an integer ≥ {at_least}, got {value!r}")
    return number


# Django's own advice for SECRET_KEY (security.W009): long and not guessable.
MIN_SECRET_LENGTH = 50


def env_secret(name: str, lab: bool, lab_default: str) -> str:
    """A secret from the environment. In the lab an unset one falls back to `lab_default`
    (public: it is in the source); outside the lab an unset or short one stops start-up."""
    value = os.environ.get(name, "")
    if value:
        if not lab and len(value) < MIN_SECRET_LENGTH:
            raise ImproperlyConfigured(
                f"{name} must be at least {MIN_SECRET_LENGTH} characters outside the lab, got "
                f"{len(value)} (e.g. python -c 'import secrets; print(secrets.token_urlsafe(50))')")
        return value
    if not lab:
        raise ImproperlyConfigured(
            f"{name} must be set: Meridian runs in production mode unless MERIDIAN_LAB=1 "
            "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(50))')")
    return lab_default


def env_proxy_ssl_header(name: str) -> tuple[str, str] | None:
    """Django's SECURE_PROXY_SSL_HEADER from `Header-Name=value` (`X-Forwarded-Proto=https`);
    None when unset."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    header, sep, expected = value.partition("=")
    header, expected = header.strip(), expected.strip()
    if not sep or not header or not expected or not all(
            c.isalnum() or c == "-" for c in header):
        raise ImproperlyConfigured(
            f"{name} must be HEADER=VALUE, e.g. X-Forwarded-Proto=https, got {value!r}")
    return "HTTP_" + header.upper().replace("-", "_"), expected


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
