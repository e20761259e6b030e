"""The shipped Prometheus config scrapes exactly the target files the control plane writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from controlplane.lab.prometheus import CONFIG, prometheus_argv


def test_the_config_reads_the_target_files_the_control_plane_writes() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    files = {job["job_name"]: job["file_sd_configs"][0]["files"] for job in config["scrape_configs"]}
    assert files == {"meridian-replicas": ["targets/replicas.json"],
                     "meridian-replicas-plain": ["targets/replicas-plain.json"],
                     "meridian-edges": ["targets/edges.json"]}
    # Replicas are scraped with a client certificate; plain ones count as the same job.
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["meridian-replicas"]["scheme"] == "https"
    assert set(jobs["meridian-replicas"]["tls_config"]) == {"ca_file", "cert_file", "key_file"}
    assert jobs["meridian-replicas-plain"]["relabel_configs"] == [
        {"target_label": "job", "replacement": "meridian-replicas"}]
    # The named queries select the replicas' job by this name.
    from controlplane.telemetry.queries import QUERIES

    assert 'job="meridian-replicas"' in QUERIES["up"]


def test_the_lab_runs_prometheus_only_when_it_is_installed(tmp_path: Path) -> None:
    import shutil

    if shutil.which("prometheus") is None:
        assert prometheus_argv(tmp_path, "127.0.0.1:9090") is None
    argv = prometheus_argv(tmp_path, "127.0.0.1:9999", binary="/opt/prometheus")
    assert argv is not None and argv[0] == "/opt/prometheus"
    home = (tmp_path / "prometheus").resolve()
    assert f"--config.file={home / 'prometheus.yml'}" in argv
    assert "--web.listen-address=127.0.0.1:9999" in argv
    assert (home / "prometheus.yml").read_text() == CONFIG.read_text()
    assert (home / "targets").is_dir()


@pytest.mark.django_db
def test_targets_written_beside_the_copied_config_carry_the_labels_queries_use(  # type: ignore[no-untyped-def]
        tmp_path, catalog):
    from controlplane.deployments.models import Deployment, Replica
    from controlplane.deployments.models import ReplicaState as S
    from controlplane.telemetry.services import write_prometheus_targets

    d = Deployment.objects.create(name="chat", served_model_name="m", model=catalog["llama8b"])
    Replica.objects.create(deployment=d, region=catalog["fra"], state=S.READY,
                           url="http://127.0.0.1:8001")
    Replica.objects.create(deployment=d, region=catalog["fra"], state=S.READY,
                           url="https://127.0.0.1:8002")
    written = write_prometheus_targets(tmp_path / "targets")
    (group,) = json.loads((written / "replicas.json").read_text())
    assert group["targets"] == ["127.0.0.1:8002"]
    (plain,) = json.loads((written / "replicas-plain.json").read_text())
    assert plain["targets"] == ["127.0.0.1:8001"]
    assert set(group["labels"]) == {"replica", "deployment", "region"}
