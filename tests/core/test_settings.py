"""Every setting is read and checked at start-up: a wrong value stops Django from starting,
with the variable named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
START = ("import django; django.setup(); from django.conf import settings; "
         "print(settings.MERIDIAN['ALERT_WEBHOOK_URL'])")


def start(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", START], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings", **env})


@pytest.mark.parametrize(("name", "value"), [
    ("MERIDIAN_REPLAN_MIN_SAVING_USD_H", "a dollar"),
    ("MERIDIAN_REPLAN_MIN_SAVING_FRACTION", "5%"),
    ("MERIDIAN_REPLAN_PRICE_CHANGE_FRACTION", "two"),
    ("MERIDIAN_REPLAN_REJECTED_COOLDOWN_H", "0"),
    ("MERIDIAN_GPU_TEMP_LIMIT_C", "hot"),
    ("MERIDIAN_GPU_XID_HOLD_MIN", "-1"),
    ("MERIDIAN_GPU_READING_RETENTION_H", "1d"),
    ("MERIDIAN_ALERT_WEBHOOK_URL", "ftp://example.org/hook"),
    ("MERIDIAN_ALERT_WEBHOOK_TIMEOUT_S", "61"),
    ("MERIDIAN_CATALOG_STALE_H", "a week"),
    ("MERIDIAN_BATCH_EDGE_URL", "edge-eu:8100"),
    ("MERIDIAN_BATCH_LEASE_S", "0"),
    ("MERIDIAN_BATCH_REQUEST_TIMEOUT_S", "two minutes"),
])
def test_a_wrong_value_stops_start_up_naming_the_variable(name: str, value: str) -> None:
    result = start(**{name: value})
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and name in result.stderr, result.stderr


def test_good_values_start() -> None:
    result = start(MERIDIAN_ALERT_WEBHOOK_URL="https://hooks.example.org/meridian",
                   MERIDIAN_ALERT_WEBHOOK_TIMEOUT_S="2.5", MERIDIAN_GPU_XID_HOLD_MIN="10")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "https://hooks.example.org/meridian"


def test_a_batch_lease_no_longer_than_a_request_stops_start_up() -> None:
    result = start(MERIDIAN_BATCH_LEASE_S="60", MERIDIAN_BATCH_REQUEST_TIMEOUT_S="60")
    assert result.returncode != 0
    assert "MERIDIAN_BATCH_LEASE_S (60) must be longer than MERIDIAN_BATCH_REQUEST_TIMEOUT_S" \
        in result.stderr, result.stderr
