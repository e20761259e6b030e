"""Renewed certificates reach SkyPilot nodes: the job that writes them (run here with bash,
as the node runs it), the adapter's `sky.exec` of it with the PEM text as secrets only, and
the delivery loop: a renewal is sent once, followed until its job succeeds, sent again when
the job or the send fails, and never sent to local replicas, which read the files
themselves."""

from __future__ import annotations

import os
import stat
import subprocess
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.utils import timezone

from controlplane.core import certificates
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.provisioning import certificate_delivery, services
from controlplane.provisioning.base import ProviderError
from controlplane.provisioning.skypilot import SkyPilotProvider
from controlplane.provisioning.skypilot_certificates import (
    job_state,
    refresh_script,
    refresh_task_yaml,
)
from controlplane.provisioning.skypilot_task import task_from_yaml
from tests.engine_ca import engine_ca

from .test_skypilot_jobs import FakeSkyWithJobs, sky_home

__all__ = ["engine_ca", "sky_home"]


class FakeSkyWithExec(FakeSkyWithJobs):
    """The fake SDK plus `exec`: each call queues a job on the cluster, PENDING until told."""

    def __init__(self) -> None:
        super().__init__()
        self.exec_tasks: list[Any] = []
        self.exec_error: BaseException | None = None

    def exec(self, task: Any, cluster_name: str, **kw: Any) -> str:
        self.calls.append(("exec", cluster_name))
        if self.exec_error is not None:
            raise self.exec_error
        self.exec_tasks.append(task)
        job = max(self.jobs, default=1) + 1
        self.jobs[job] = "PENDING"
        return self._request("exec", (job, None))


def secrets_of(task: Any) -> dict[str, str]:
    return {k: v.get_secret_value() for k, v in task.secrets.items()}


def test_the_refresh_job_replaces_each_file_whole_and_keeps_the_key_private(tmp_path) -> None:  # type: ignore[no-untyped-def]
    directory = tmp_path / ".meridian-tls"
    directory.mkdir()
    (directory / "cert.pem").write_text("old cert\n")
    env = {**os.environ, "MERIDIAN_TLS_CERT": "new cert", "MERIDIAN_TLS_KEY": "new key",
           "MERIDIAN_TLS_CA": "the ca"}
    subprocess.run(["bash", "-c", refresh_script()], cwd=tmp_path, env=env, check=True,
                   timeout=30)
    assert {p.name for p in directory.iterdir()} == {"cert.pem", "key.pem", "ca.pem"}
    assert (directory / "cert.pem").read_text() == "new cert\n"
    assert (directory / "key.pem").read_text() == "new key\n"
    assert stat.S_IMODE((directory / "key.pem").stat().st_mode) == 0o600
    # Without its secrets it fails (set -u) and leaves the files it had.
    env.pop("MERIDIAN_TLS_KEY")
    failed = subprocess.run(["bash", "-c", refresh_script()], cwd=tmp_path, env=env,
                            timeout=30, capture_output=True)
    assert failed.returncode != 0 and (directory / "key.pem").read_text() == "new key\n"


def test_the_refresh_task_is_valid_for_skypilot_and_carries_no_pem(sky_home) -> None:  # type: ignore[no-untyped-def]
    text = refresh_task_yaml("r-12")
    config = yaml.safe_load(text)
    assert set(config["secrets"]) == {"MERIDIAN_TLS_CERT", "MERIDIAN_TLS_KEY", "MERIDIAN_TLS_CA"}
    assert "resources" not in config  # no accelerator: it runs beside the engine's job
    task = task_from_yaml(text, None, [("MERIDIAN_TLS_CERT", "-----C-----"),
                                       ("MERIDIAN_TLS_KEY", "-----K-----"),
                                       ("MERIDIAN_TLS_CA", "-----A-----")])
    assert secrets_of(task)["MERIDIAN_TLS_KEY"] == "-----K-----"
    assert "-----" not in str(task.run)


@pytest.mark.parametrize("answer,state", [
    ({3: "SUCCEEDED"}, "done"), ({"3": "RUNNING"}, "pending"), ({3: "PENDING"}, "pending"),
    ({3: "FAILED"}, "failed"), ({}, "failed"), (None, "failed"),
])
def test_job_state(answer, state) -> None:  # type: ignore[no-untyped-def]
    assert job_state(answer, "3") == state


@pytest.fixture
def fake(sky_home):  # type: ignore[no-untyped-def]
    return FakeSkyWithExec()


@pytest.fixture
def sky_provider(fake):  # type: ignore[no-untyped-def]
    provider = SkyPilotProvider(sdk=fake, timeout_s=5.0, retry_backoff_s=0.0,
                                environ={"MERIDIAN_ENGINE_API_KEY": "unused"})
    services.set_provider("skypilot", provider)
    yield provider
    services.set_provider("skypilot", None)


def cloud_replica(catalog: dict[str, Any], var: Path, provider: str = "skypilot",
                  state: str = S.READY) -> Replica:
    deployment = Deployment.objects.create(
        name=f"d-{provider}-{state}", served_model_name=f"m-{provider}-{state}",
        model=catalog["llama8b"], min_replicas=1, max_replicas=1, max_model_len=4096)
    replica = Replica.objects.create(deployment=deployment, region=catalog["fra"],
                                     provider=provider, state=state)
    rid = replica.public_id
    row, _ = certificates.issue(f"replica:{rid}", "server", rid,
                                [certificates.replica_tls_name(rid)], var / rid)
    replica.provider_handle = {"provider": provider, "id": rid,
                               "data": {"cluster": f"mrd-{rid}"},
                               "tls": {"serial": row.serial, "job": None}}
    replica.save(update_fields=["provider_handle"])
    return replica


def renew_all() -> None:
    later = timezone.now() + certificates.lifetime() * 0.9
    assert certificates.renew_due(now=later)


@pytest.mark.django_db
def test_a_renewal_is_sent_once_and_followed_until_its_job_succeeds(  # type: ignore[no-untyped-def]
        catalog, engine_ca, sky_provider, fake, tmp_path) -> None:
    replica = cloud_replica(catalog, tmp_path)
    fake.cluster_up(f"mrd-{replica.public_id}")
    assert certificate_delivery.deliver_renewed()["sent"] == []  # the launch's is current
    renew_all()
    new = certificates.current(f"replica:{replica.public_id}")
    assert new is not None
    assert certificate_delivery.deliver_renewed()["sent"] == [replica.public_id]
    (task,) = fake.exec_tasks
    assert secrets_of(task)["MERIDIAN_TLS_CERT"] == Path(new.install_dir, "cert.pem").read_text()
    assert fake.calls[-1] == ("exec", f"mrd-{replica.public_id}")
    record = certificate_delivery.delivered(Replica.objects.get(pk=replica.pk))
    assert record == {"serial": new.serial, "job": "2"}
    # Its job has not run yet: followed, not sent again.
    assert certificate_delivery.deliver_renewed()["pending"] == [replica.public_id]
    fake.jobs[2] = "SUCCEEDED"
    assert certificate_delivery.deliver_renewed()["confirmed"] == [replica.public_id]
    assert certificate_delivery.deliver_renewed() == {"sent": [], "confirmed": [],
                                                      "pending": [], "failed": []}
    assert len(fake.exec_tasks) == 1
    # The rest of the handle is kept.
    assert Replica.objects.get(pk=replica.pk).provider_handle["data"] == {
        "cluster": f"mrd-{replica.public_id}"}


@pytest.mark.django_db
def test_a_failed_job_or_send_is_sent_again(catalog, engine_ca, sky_provider, fake,  # type: ignore[no-untyped-def]
                                            tmp_path) -> None:
    import sky.exceptions

    replica = cloud_replica(catalog, tmp_path)
    fake.cluster_up(f"mrd-{replica.public_id}")
    renew_all()
    fake.exec_error = sky.exceptions.ApiServerConnectionError("http://127.0.0.1:46580")
    assert certificate_delivery.deliver_renewed()["failed"] == [replica.public_id]
    fake.exec_error = None
    assert certificate_delivery.deliver_renewed()["sent"] == [replica.public_id]
    fake.jobs[2] = "FAILED"
    assert certificate_delivery.deliver_renewed()["sent"] == [replica.public_id]
    assert len(fake.exec_tasks) == 2
    fake.jobs[3] = "SUCCEEDED"
    assert certificate_delivery.deliver_renewed()["confirmed"] == [replica.public_id]


@pytest.mark.django_db
def test_local_replicas_and_replicas_without_a_node_are_left_alone(  # type: ignore[no-untyped-def]
        catalog, engine_ca, sky_provider, fake, tmp_path, local_provider) -> None:
    services.set_provider("local", local_provider)
    try:
        cloud_replica(catalog, tmp_path, provider="local")
        cloud_replica(catalog, tmp_path, state=S.PROVISIONING)
        cloud_replica(catalog, tmp_path, state=S.TERMINATED)
        renew_all()
        assert certificate_delivery.deliver_renewed()["sent"] == []
    finally:
        services.set_provider("local", None)
    assert fake.exec_tasks == []


@pytest.mark.django_db
def test_a_revoked_certificate_is_neither_renewed_nor_sent(catalog, engine_ca,  # type: ignore[no-untyped-def]
                                                          sky_provider, fake, tmp_path) -> None:
    replica = cloud_replica(catalog, tmp_path)
    row = certificates.current(f"replica:{replica.public_id}")
    assert row is not None
    certificates.revoke(row.serial, "node compromised", "ops")
    later = timezone.now() + timedelta(hours=40)
    assert certificates.renew_due(now=later) == []
    assert certificate_delivery.deliver_renewed()["sent"] == []
    assert fake.exec_tasks == []


def test_a_handle_without_a_cluster_is_refused(sky_provider, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from controlplane.provisioning.base import ProviderHandle

    with pytest.raises(ProviderError) as caught:
        sky_provider.deliver_certificate(ProviderHandle("skypilot", "r-1", {}), str(tmp_path))
    assert caught.value.kind == "credentials"  # its files are not there either
