"""The lab's fleet in a test database: the shipped catalog, the demo tenant, and a local
provider over a throwaway state directory (so that stopping replicas never reaps another
lab's engines). Celery tasks are recorded, not sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.provisioning import services
from controlplane.provisioning.local import LocalProvider
from controlplane.provisioning.local_regions import LabRegion

LAB_REGIONS = [
    LabRegion("local:eu-frankfurt", 50.11, 8.68),
    LabRegion("local:us-virginia", 38.95, -77.45),
    LabRegion("local:ap-tokyo", 35.68, 139.77),
]


@pytest.fixture
def lab_database(db, sent_tasks, tmp_path: Path,  # type: ignore[no-untyped-def]
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from django.core.management import call_command

    from controlplane.core.models import Tenant

    call_command("seed_catalog", verbosity=0)
    # The lab's stop refreshes a connection a long run may have lost; here it would close
    # the test's own transaction.
    monkeypatch.setattr("controlplane.lab.fleet.close_old_connections", lambda: None)
    Tenant.objects.get_or_create(name="demo", defaults={"display_name": "Demo tenant"})
    services.set_provider("local", LocalProvider(tmp_path / "replicas", LAB_REGIONS,
                                                 engine="enginesim"))
    try:
        yield
    finally:
        services.set_provider("local", None)
