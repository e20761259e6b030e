"""Django settings for the Meridian control plane, read from the environment.

Every variable is optional in the lab: DATABASE_URL and REDIS_URL default to the local
servers when they answer and to embedded ones otherwise (controlplane.lab.backing).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import TypedDict

from django.core.exceptions import ImproperlyConfigured

from controlplane.env import (
    database_from_url,
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_proxy_ssl_header,
    env_secret,
    env_str,
    env_url,
)
from controlplane.lab import backing

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("MERIDIAN_VAR_DIR", str(BASE_DIR / "var")))

DEBUG = env_bool("DEBUG", False)
# Production unless told otherwise: `make up` and `make test` set MERIDIAN_LAB=1, and so does
# every pytest run (controlplane/lab/pytest_plugin.py). Outside the lab every secret must come
# from the environment and HTTPS is assumed.
LAB = env_bool("MERIDIAN_LAB", False)
SECRET_KEY = env_secret("SECRET_KEY", LAB, "lab-only-insecure-key-set-SECRET_KEY-in-production")
# The secret batch runner keys are derived from (controlplane/batches/runner_key.py): its own,
# so that neither SECRET_KEY nor a batch id (in every x-request-id) gives a runner key away.
BATCH_KEY_SECRET = env_secret("MERIDIAN_BATCH_KEY_SECRET", LAB,
                              "lab-only-insecure-batch-key-secret-set-MERIDIAN_BATCH_KEY_SECRET")
if BATCH_KEY_SECRET == SECRET_KEY:
    raise ImproperlyConfigured("MERIDIAN_BATCH_KEY_SECRET must differ from SECRET_KEY")
# mTLS between edges and engines (controlplane/core/certificates.py): replicas start with a
# server certificate from the engine CA and demand client certificates. Off only where a test
# runs fake engines on plain HTTP (MERIDIAN_ENGINE_TLS=0, set by the pytest plugin; the lab
# itself always runs with it on).
ENGINE_TLS = env_bool("MERIDIAN_ENGINE_TLS", True)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])
# HTTPS outside the lab: secure cookies, HSTS, a redirect from plain HTTP. Behind a proxy that
# ends TLS, MERIDIAN_SECURE_PROXY_SSL_HEADER names the header it sets (`X-Forwarded-Proto`):
# unset, no header is trusted, since a client could send it itself.
SESSION_COOKIE_SECURE = env_bool("MERIDIAN_SECURE_COOKIES", not LAB)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
SECURE_SSL_REDIRECT = env_bool("MERIDIAN_SSL_REDIRECT", not LAB)
SECURE_HSTS_SECONDS = env_int("MERIDIAN_HSTS_SECONDS", 0 if LAB else 31_536_000, at_least=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("MERIDIAN_HSTS_INCLUDE_SUBDOMAINS", not LAB)
SECURE_HSTS_PRELOAD = env_bool("MERIDIAN_HSTS_PRELOAD", not LAB)
SECURE_PROXY_SSL_HEADER = env_proxy_ssl_header("MERIDIAN_SECURE_PROXY_SSL_HEADER")
# Probes and the edges' table pulls from inside the network may use plain HTTP to these.
SECURE_REDIRECT_EXEMPT = env_list("MERIDIAN_SSL_REDIRECT_EXEMPT", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "controlplane.core",
    "regions",
    "controlplane.deployments",
    "controlplane.placement",
    "controlplane.provisioning",
    "controlplane.routing",
    "controlplane.telemetry",
    "controlplane.failover",
    "controlplane.scaling",
    "controlplane.batches",
    "controlplane.plans",
    "controlplane.rollouts",
    "controlplane.costs",
    "controlplane.alerts",
    "controlplane.api",
    "frontend",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASE_URL = os.environ.get("DATABASE_URL") or backing.lab_database_url()
DATABASES = {"default": database_from_url("DATABASE_URL", DATABASE_URL)}
if os.environ.get("MERIDIAN_TEST_DB"):  # lets two test runs share one server
    DATABASES["default"]["TEST"] = {"NAME": os.environ["MERIDIAN_TEST_DB"]}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = os.environ.get("REDIS_URL") or backing.lab_redis_url()
if not REDIS_URL.startswith(("redis://", "rediss://", "redis+socket://", "unix://")):
    raise ImproperlyConfigured(f"REDIS_URL must be a redis:// URL, got {REDIS_URL!r}")

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # whitenoise warns on every request otherwise
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.core.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["controlplane.api.permissions.RolePermission"],
    "DEFAULT_PAGINATION_CLASS": "controlplane.api.pagination.Pagination",
    "PAGE_SIZE": 50,
    # Lists refuse what they would ignore: unknown parameters and orderings (400, named).
    "DEFAULT_FILTER_BACKENDS": [
        "controlplane.api.query_params.KnownQueryParams",
        "django_filters.rest_framework.DjangoFilterBackend",
        "controlplane.api.ordering.StrictOrderingFilter",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "controlplane.api.errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Meridian control plane API",
    "DESCRIPTION": "Clouds, regions, GPU offers, quota, tenants, deployments and replicas.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # Several models have a `status`; each set of choices gets its own name in the schema.
    "ENUM_NAME_OVERRIDES": {
        "PlanStatusEnum": "controlplane.placement.models.PlanStatus",
        "OperationStatusEnum": "controlplane.provisioning.models.OperationStatus",
        "BatchStatusEnum": "controlplane.batches.models.BatchStatus",
    },
}

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_ROUTES = {"provisioning.*": {"queue": "provision"}, "batches.*": {"queue": "batch"}}
# Any one worker may die at any moment (DESIGN §6): a task is acknowledged once it has run,
# a task whose pool process was killed goes back to the queue, and a worker holds one
# message at a time. Every task is safe to run twice; the reconcile loops find again from
# the rows what a worker took with it (countdown messages held in its memory).
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_TIMEZONE = "UTC"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)

# Where batch workers send a batch's lines: an edge's public URL, at batch tier. Unset: the
# first enabled edge in the registry; no edge at all: straight to the replicas.
# How long a deployment's load must stay low before the autoscaler scales it down (the
# batch tier with min_replicas 0: idle this long, to zero).
SCALE_DOWN_WINDOW_S = env_float("MERIDIAN_SCALE_DOWN_WINDOW_S", 60.0, above=0)
BATCH_EDGE_URL = env_url("MERIDIAN_BATCH_EDGE_URL")
# A line's request gives up after BATCH_REQUEST_TIMEOUT_S; a line claimed longer ago than
# BATCH_LEASE_S belongs to a worker that died and is claimed again, so the lease must be the
# longer (else a live send could be sent twice).
BATCH_REQUEST_TIMEOUT_S = env_float("MERIDIAN_BATCH_REQUEST_TIMEOUT_S", 120.0, above=0)
BATCH_LEASE_S = env_float("MERIDIAN_BATCH_LEASE_S", 600.0, above=0)
if BATCH_LEASE_S <= BATCH_REQUEST_TIMEOUT_S:
    raise ImproperlyConfigured(
        f"MERIDIAN_BATCH_LEASE_S ({BATCH_LEASE_S:g}) must be longer than "
        f"MERIDIAN_BATCH_REQUEST_TIMEOUT_S ({BATCH_REQUEST_TIMEOUT_S:g})")
# An upload to POST /v1/files gets BATCH_UPLOAD_GRACE_S, then must average
# BATCH_UPLOAD_MIN_BYTES_PER_S (0: no minimum) or it is cut with a 408 (api.batch_uploads),
# as at the edges.
BATCH_UPLOAD_GRACE_S = env_float("MERIDIAN_BATCH_UPLOAD_GRACE_S", 30.0, above=0)
BATCH_UPLOAD_MIN_BYTES_PER_S = env_int("MERIDIAN_BATCH_UPLOAD_MIN_BYTES_PER_S", 64 * 1024,
                                       at_least=0)


class MeridianSettings(TypedDict):
    HEARTBEAT_S: float
    HEARTBEAT_MISSED: int
    HEARTBEAT_FORGET_AFTER: timedelta
    CATALOG_STALE_AFTER: timedelta
    PLACEMENT_CLOUDS: list[str]
    DEFAULT_ENGINE: str
    REPLAN_MIN_SAVING_USD_H: float
    REPLAN_MIN_SAVING_FRACTION: float
    REPLAN_PRICE_CHANGE_FRACTION: float
    REPLAN_REJECTED_COOLDOWN: timedelta
    GPU_TEMP_LIMIT_C: float
    GPU_XID_HOLD: timedelta
    GPU_READING_RETENTION: timedelta
    ALERT_WEBHOOK_URL: str | None
    ALERT_WEBHOOK_TIMEOUT_S: float
    LAB_NETNS: str


MERIDIAN: MeridianSettings = {
    # Every Celery worker and beat records a heartbeat in Redis this often
    # (controlplane.core.heartbeats); /api/v1/status/ reports one that missed HEARTBEAT_MISSED
    # of them as stale, and a dead process's record is forgotten after HEARTBEAT_FORGET_AFTER.
    "HEARTBEAT_S": env_float("MERIDIAN_HEARTBEAT_S", 5.0, above=0),
    "HEARTBEAT_MISSED": env_int("MERIDIAN_HEARTBEAT_MISSED", 3, at_least=1),
    "HEARTBEAT_FORGET_AFTER": timedelta(
        seconds=env_int("MERIDIAN_HEARTBEAT_FORGET_S", 600, at_least=1)),
    "CATALOG_STALE_AFTER": timedelta(hours=env_int("MERIDIAN_CATALOG_STALE_H", 24 * 7)),
    # Clouds the solver may place new replicas on (empty: every enabled cloud). The lab
    # sets "local": it can launch nothing else.
    "PLACEMENT_CLOUDS": env_list("MERIDIAN_PLACEMENT_CLOUDS", []),
    # The engine a new deployment runs unless it names one: a real vLLM, or enginesim (the
    # simulator; local regions only). The lab sets enginesim unless started with ENGINE=vllm.
    "DEFAULT_ENGINE": env_choice("MERIDIAN_DEFAULT_ENGINE", "vllm", ("vllm", "enginesim")),
    # The periodic replan proposes a plan only when it saves this much (plans/replan.py),
    # looks again when an offer's price moved by this fraction, and leaves a rejected plan's
    # deployments alone for the cooldown.
    "REPLAN_MIN_SAVING_USD_H": env_float("MERIDIAN_REPLAN_MIN_SAVING_USD_H", 1.0),
    "REPLAN_MIN_SAVING_FRACTION": env_float("MERIDIAN_REPLAN_MIN_SAVING_FRACTION", 0.05),
    "REPLAN_PRICE_CHANGE_FRACTION": env_float("MERIDIAN_REPLAN_PRICE_CHANGE_FRACTION", 0.02),
    "REPLAN_REJECTED_COOLDOWN": timedelta(
        hours=env_float("MERIDIAN_REPLAN_REJECTED_COOLDOWN_H", 24.0, above=0)),
    # GPU health (telemetry/gpu_reports.py): the temperature a GPU is judged hot at, how long a
    # critical XID keeps a node unhealthy, and how long readings are kept.
    "GPU_TEMP_LIMIT_C": env_float("MERIDIAN_GPU_TEMP_LIMIT_C", 85.0, above=0, at_most=200),
    "GPU_XID_HOLD": timedelta(minutes=env_float("MERIDIAN_GPU_XID_HOLD_MIN", 60.0, above=0)),
    "GPU_READING_RETENTION": timedelta(
        hours=env_float("MERIDIAN_GPU_READING_RETENTION_H", 24.0, above=0)),
    # Where alerts are POSTed (unset: nowhere), and how long one POST may take.
    "ALERT_WEBHOOK_URL": env_url("MERIDIAN_ALERT_WEBHOOK_URL"),
    "ALERT_WEBHOOK_TIMEOUT_S": env_float("MERIDIAN_ALERT_WEBHOOK_TIMEOUT_S", 5.0,
                                         above=0, at_most=60),
    # Lab regions whose engines run in a network namespace (REGION=NAMESPACE@ADDRESS, comma
    # separated; provisioning/local.py parse_netns), as bench/failover.py --fault partition
    # sets it. Unset: every lab engine on this machine's loopback.
    "LAB_NETNS": env_str("MERIDIAN_LAB_NETNS", ""),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
