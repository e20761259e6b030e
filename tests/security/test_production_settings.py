"""Production is the default: without MERIDIAN_LAB=1 the control plane starts only with its
secrets set, serves over HTTPS only, and passes Django's deployment checks (drf-spectacular's
warnings included). Each case starts Django in a subprocess with the environment it names."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHOW = ("import django; django.setup(); from django.conf import settings as s; "
        "print(s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_SSL_REDIRECT, "
        "s.SECURE_HSTS_SECONDS, s.SECURE_PROXY_SSL_HEADER, s.LAB)")


def production_env(**env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MERIDIAN_", "SECRET_KEY"))}
    base.update(DJANGO_SETTINGS_MODULE="controlplane.settings", SECRET_KEY=secrets.token_urlsafe(50),
                MERIDIAN_BATCH_KEY_SECRET=secrets.token_urlsafe(50))
    base.update(env)
    return {k: v for k, v in base.items() if v != "<unset>"}


def run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env=production_env(**env))


def test_check_deploy_passes_with_production_settings() -> None:
    result = run(["manage.py", "check", "--deploy", "--fail-level", "WARNING"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_production_defaults_are_the_safe_ones() -> None:
    result = run(["-c", SHOW])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "True", "31536000", "None", "False"]


def test_lab_mode_is_opt_in_and_relaxes_https() -> None:
    result = run(["-c", SHOW], MERIDIAN_LAB="1", SECRET_KEY="<unset>",
                 MERIDIAN_BATCH_KEY_SECRET="<unset>")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "False", "0", "None", "True"]


def test_each_setting_can_be_set() -> None:
    result = run(["-c", SHOW], MERIDIAN_SECURE_COOKIES="0", MERIDIAN_SSL_REDIRECT="0",
                 MERIDIAN_HSTS_SECONDS="3600", MERIDIAN_SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto=https")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "False", "3600",
                                     "('HTTP_X_FORWARDED_PROTO',", "'https')", "False"]


@pytest.mark.parametrize("name", ["SECRET_KEY", "MERIDIAN_BATCH_KEY_SECRET"])
def test_a_missing_secret_stops_start_up_naming_it(name: str) -> None:
    result = run(["-c", SHOW], **{name: "<unset>"})
    assert result.returncode != 0
    assert f"{name} must be set" in result.stderr, result.stderr
    assert "MERIDIAN_LAB=1" in result.stderr


@pytest.mark.parametrize("name", ["SECRET_KEY", "MERIDIAN_BATCH_KEY_SECRET"])
def test_a_short_secret_stops_start_up(name: str) -> None:
    result = run(["-c", SHOW], **{name: "hunter2"})
    assert result.returncode != 0
    assert f"{name} must be at least 50 characters" in result.stderr, result.stderr


def test_the_batch_key_secret_must_differ_from_secret_key() -> None:
    same = secrets.token_urlsafe(50)
    result = run(["-c", SHOW], SECRET_KEY=same, MERIDIAN_BATCH_KEY_SECRET=same)
    assert result.returncode != 0
    assert "MERIDIAN_BATCH_KEY_SECRET must differ from SECRET_KEY" in result.stderr


@pytest.mark.parametrize(("name", "value"), [
    ("MERIDIAN_SECURE_PROXY_SSL_HEADER", "X-Forwarded-Proto"),
    ("MERIDIAN_SECURE_PROXY_SSL_HEADER", "X Forwarded=https"),
    ("MERIDIAN_HSTS_SECONDS", "-1"),
    ("MERIDIAN_HSTS_SECONDS", "a year"),
    ("MERIDIAN_SSL_REDIRECT", "maybe"),
    ("MERIDIAN_LAB", "lab"),
])
def test_a_wrong_value_stops_start_up_naming_the_variable(name: str, value: str) -> None:
    result = run(["-c", SHOW], **{name: value})
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and name in result.stderr, result.stderr


def test_plain_http_is_redirected_and_cookies_are_secure_in_production() -> None:
    probe = ("import django; django.setup(); from django.test import Client; "
             "c = Client(); r = c.get('/login/'); print(r.status_code, r['Location']); "
             "r = c.get('/login/', secure=True); print(r.status_code, "
             "r['Strict-Transport-Security'], r.cookies['csrftoken']['secure'])")
    result = run(["-c", probe], ALLOWED_HOSTS="testserver")
    assert result.returncode == 0, result.stderr
    redirect, served = result.stdout.splitlines()
    assert redirect == "301 https://testserver/login/"
    assert served == "200 max-age=31536000; includeSubDomains; preload True"


def test_batch_runner_keys_come_from_their_own_secret() -> None:
    derive = ("import django; django.setup(); "
              "from controlplane.batches.runner_key import runner_secret; "
              "print(runner_secret('batch_abc'))")
    secret_key, batch_secret = secrets.token_urlsafe(50), secrets.token_urlsafe(50)
    first = run(["-c", derive], SECRET_KEY=secret_key, MERIDIAN_BATCH_KEY_SECRET=batch_secret)
    same_batch_secret = run(["-c", derive], SECRET_KEY=secrets.token_urlsafe(50),
                            MERIDIAN_BATCH_KEY_SECRET=batch_secret)
    other_batch_secret = run(["-c", derive], SECRET_KEY=secret_key,
                             MERIDIAN_BATCH_KEY_SECRET=secrets.token_urlsafe(50))
    assert first.returncode == 0, first.stderr
    assert first.stdout == same_batch_secret.stdout  # SECRET_KEY plays no part
    assert first.stdout != other_batch_secret.stdout
