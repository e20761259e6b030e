"""Shared fixtures: a small real catalog in Postgres, tenants, and API clients per role."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest

from controlplane.lab import netns

os.environ.setdefault("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")

# Parameter values that mean "against a real vLLM" (the contract suite's and Prometheus's).
REAL_ENGINE_PARAMS = {"vllm", "vllm-cpu"}
_real_engine_outcomes: dict[str, int] = {}


TESTS = Path(__file__).resolve().parent
# Tests that start a whole lab (web, workers, beat, edges): one at a time, on one worker, as
# each lab's Celery workers would take the tasks of another lab sharing its Redis database.
LAB_FILES = {"e2e/test_lab.py", "e2e/test_lab_shutdown.py", "bench/test_benchmarks.py"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that runs against a real vLLM, so the run can say how many did, and
    give each test its pytest-xdist group (`--dist loadgroup` in `make test`)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = {str(v) for v in callspec.params.values()} if callspec else set()
        if params & REAL_ENGINE_PARAMS:
            item.add_marker(pytest.mark.real_engine)
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def xdist_group(item: pytest.Item) -> str | None:
    """Which tests must share a worker: those that start a lab (all of them, one after
    another), and those that share a fixture wider than a test (a module's or a package's
    engine, edge or server), so that it starts once. Every other test goes wherever a worker
    is free."""
    path = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
    if path in LAB_FILES:
        return "labs"
    fixture_info = getattr(item, "_fixtureinfo", None)
    # The suite's own fixtures (a plugin's, such as pytest-django's, are made on every worker)
    scopes = {definition.scope for definitions in (
        fixture_info.name2fixturedefs.values() if fixture_info else ())
        for definition in definitions if definition.baseid.startswith("tests")}
    if "package" in scopes:
        return path.rsplit("/", 1)[0]
    if scopes & {"module", "class"}:
        return path
    return None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "real_engine" not in report.keywords:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _real_engine_outcomes[report.outcome] = _real_engine_outcomes.get(report.outcome, 0) + 1


def pytest_terminal_summary(terminalreporter: object) -> None:
    if _real_engine_outcomes:
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(_real_engine_outcomes.items()))
        terminalreporter.write_line(  # type: ignore[attr-defined]
            f"against a real vLLM engine: {sum(_real_engine_outcomes.values())} tests ({counts})")


@pytest.fixture
def catalog(db):  # type: ignore[no-untyped-def]
    """Two jurisdictions, two clouds, three regions, two GPU types, offers, quota, models."""
    from controlplane.deployments.models import Model
    from regions.models import Cloud, GpuType, Jurisdiction, Offer, Quota, Region

    seen = datetime(2026, 11, 1, tzinfo=UTC)
    eu = Jurisdiction.objects.create(code="EU", name="European Union")
    us = Jurisdiction.objects.create(code="US", name="United States")
    aws = Cloud.objects.create(name="aws", display_name="AWS", skypilot_name="aws")
    gcp = Cloud.objects.create(name="gcp", display_name="GCP", skypilot_name="gcp")
    fra = Region.objects.create(
        cloud=aws, code="eu-central-1", display_name="Frankfurt", latitude=50.1,
        longitude=8.7, country="DE", jurisdiction=eu,
    )
    iad = Region.objects.create(
        cloud=aws, code="us-east-1", display_name="N. Virginia", latitude=38.9,
        longitude=-77.4, country="US", jurisdiction=us,
    )
    ams = Region.objects.create(
        cloud=gcp, code="europe-west4", display_name="Eemshaven", latitude=53.4,
        longitude=6.8, country="NL", jurisdiction=eu,
    )
    h100 = GpuType.objects.create(
        name="H100", memory_gib=80, memory_bandwidth_gbps=3350, bf16_tflops=989,
        fp16_tflops=989, skypilot_name="H100",
    )
    l4 = GpuType.objects.create(
        name="L4", memory_gib=24, memory_bandwidth_gbps=300, bf16_tflops=121,
        fp16_tflops=121, skypilot_name="L4",
    )
    for region, price in ((fra, "12.29"), (iad, "11.06"), (ams, "11.50")):
        Offer.objects.create(
            region=region, gpu_type=h100, gpus_per_node=1, instance_type="h100x1",
            on_demand_usd_h=Decimal(price), spot_usd_h=Decimal(price) / 2, observed_at=seen,
        )
        Offer.objects.create(
            region=region, gpu_type=l4, gpus_per_node=1, instance_type="l4x1",
            on_demand_usd_h=Decimal("0.80"), spot_usd_h=None, observed_at=seen,
        )
        Quota.objects.create(region=region, gpu_type=h100, limit_gpus=16, observed_at=seen)
    llama8b = Model.objects.create(
        name="llama-3.1-8b-instruct", hf_id="meta-llama/Llama-3.1-8B-Instruct", family="llama",
        parameters_b=8.03, layers=32, hidden_size=4096, attention_heads=32, kv_heads=8,
        head_dim=128, max_context=131072,
    )
    return {
        "eu": eu, "us": us, "aws": aws, "gcp": gcp, "fra": fra, "iad": iad, "ams": ams,
        "h100": h100, "l4": l4, "llama8b": llama8b,
    }


@pytest.fixture
def netns_lab() -> Iterator[netns.Lab]:
    """Lab regions in network namespaces (controlplane/lab/netns.py); skipped, saying why, where they
    cannot be made."""
    reason = netns.why_unavailable()
    if reason:
        pytest.skip(reason)
    with netns.lab() as made:
        yield made


SentTask = tuple[str, tuple[object, ...], dict[str, object]]


@pytest.fixture
def sent_tasks(monkeypatch: pytest.MonkeyPatch) -> list[SentTask]:
    """Celery is the boundary: tasks are recorded here instead of reaching the broker."""
    from celery.app.task import Task

    sent: list[SentTask] = []

    def apply_async(self: Task, args: Iterable[object] | None = None,
                    kwargs: Mapping[str, object] | None = None, **options: object) -> None:
        sent.append((self.name, tuple(args or ()), dict(options)))

    monkeypatch.setattr(Task, "apply_async", apply_async)
    return sent


@pytest.fixture
def api_schema():  # type: ignore[no-untyped-def]
    """The API's OpenAPI schema, called through WSGI, for schemathesis fuzzing."""
    import schemathesis
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    from controlplane.wsgi import application

    # Raw WSGI calls would close the test's connection at the end of each request, as the
    # Django test client avoids doing by the same means.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield schemathesis.openapi.from_wsgi("/api/schema/", application)
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def tenants(catalog):  # type: ignore[no-untyped-def]
    from controlplane.core.models import Tenant

    acme = Tenant.objects.create(name="acme", display_name="Acme GmbH")
    acme.allowed_jurisdictions.set([catalog["eu"]])
    globex = Tenant.objects.create(name="globex", display_name="Globex Inc")
    globex.allowed_jurisdictions.set([catalog["us"], catalog["eu"]])
    return {"acme": acme, "globex": globex}


@pytest.fixture
def make_client(db) -> Callable[..., object]:  # type: ignore[no-untyped-def]
    """An APIClient authenticated with a fresh bearer token for a user of the given role."""
    from rest_framework.test import APIClient

    from controlplane.core.services import ensure_user, issue_api_token

    def make(role: str | None, tenant=None, username: str | None = None) -> APIClient:  # type: ignore[no-untyped-def]
        client = APIClient()
        if role is None:
            return client
        name = username or f"{role}-{tenant.name if tenant else 'platform'}"
        user = ensure_user(name, role, tenant)
        _, token = issue_api_token(user)
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        return client

    return make
