"""The SkyPilot adapter beyond the cluster: what a cloud cannot do is refused before launch,
the `vllm serve` job's fate decides the replica's, failed launches say why as data, requests
that are safe to repeat are repeated, and the real SkyPilot catalog is read (or reported
unreachable, quickly) in a process of its own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from controlplane.provisioning.base import ProviderError
from controlplane.provisioning.skypilot import DEFAULT_CLOUDS, SkyPilotProvider
from controlplane.provisioning.skypilot_task import render_replica_task, validate_replica_task

from .test_skypilot import FakeSky, spec

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def sky_home(tmp_path_factory):  # type: ignore[no-untyped-def]
    """SkyPilot writes under ~/.sky and may report usage: a throwaway HOME, no reports."""
    saved = {k: os.environ.get(k) for k in ("HOME", "SKYPILOT_DISABLE_USAGE_COLLECTION")}
    home = tmp_path_factory.mktemp("sky-home")
    os.environ["HOME"] = str(home)
    os.environ["SKYPILOT_DISABLE_USAGE_COLLECTION"] = "1"
    yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def sky_exc(sky_home):  # type: ignore[no-untyped-def]
    import sky.exceptions

    return sky.exceptions


@pytest.mark.parametrize("kw,refusal", [
    ({"cloud": "lambda", "region": "us-east-1", "use_spot": True},
     "Lambda does not support spot instances (use_spot) (asked for H100:1 × 1 node(s) in "
     "lambda:us-east-1)"),
    ({"cloud": "runpod", "region": "CA", "gpus_per_node": 8, "nodes": 2, "tensor_parallel": 8,
      "pipeline_parallel": 2},
     "RunPod does not support multi-node clusters (pipeline parallelism over nodes)"),
    ({"cloud": "aws", "region": "us-east-1", "use_spot": True, "gpus_per_node": 8,
      "nodes": 2, "tensor_parallel": 8, "pipeline_parallel": 2}, None),
    ({"cloud": "lambda", "region": "us-east-1", "gpus_per_node": 8, "nodes": 2,
      "tensor_parallel": 8, "pipeline_parallel": 2}, None),
])
def test_what_a_cloud_cannot_do_is_refused_by_name(kw, refusal) -> None:  # type: ignore[no-untyped-def]
    text = render_replica_task(spec(**kw))
    if refusal is None:
        validate_replica_task(text)
        return
    with pytest.raises(ProviderError) as caught:
        validate_replica_task(text)
    assert caught.value.kind == "invalid" and refusal in caught.value.message


class FakeSkyWithJobs(FakeSky):
    """The fake SDK plus the job queue of the cluster and flaky submissions."""

    def __init__(self) -> None:
        super().__init__()
        self.jobs: dict[int, str] = {}
        self.failures_before_launch: list[BaseException] = []
        self.failures_before_down: list[BaseException] = []

    def launch(self, task: Any, cluster_name: str, **kw: Any) -> str:
        if self.failures_before_launch:
            self.calls.append(("launch", cluster_name))
            raise self.failures_before_launch.pop(0)
        return super().launch(task, cluster_name, **kw)

    def down(self, cluster: str) -> str:
        if self.failures_before_down:
            self.calls.append(("down", cluster))
            raise self.failures_before_down.pop(0)
        return super().down(cluster)

    def job_status(self, cluster: str, job_ids: list[int] | None = None) -> str:
        self.calls.append(("job_status", job_ids))
        if cluster not in self.clusters:  # as SkyPilot's API server answers
            import sky.exceptions

            return self._request("job_status", error=sky.exceptions.ClusterDoesNotExist(
                f"Cluster {cluster!r} does not exist."))
        wanted = job_ids if job_ids is not None else sorted(self.jobs)[-1:]
        return self._request("job_status", {j: self.jobs.get(j) for j in wanted})


@pytest.fixture
def fake(sky_home):  # type: ignore[no-untyped-def]
    return FakeSkyWithJobs()


@pytest.fixture
def provider(fake):  # type: ignore[no-untyped-def]
    return SkyPilotProvider(sdk=fake, timeout_s=2.0, retry_backoff_s=0.0,
                            environ={"MERIDIAN_ENGINE_API_KEY": "sk-engine-secret"})


def launched(fake: FakeSkyWithJobs, provider: SkyPilotProvider, job_state: str):  # type: ignore[no-untyped-def]
    handle = provider.launch(spec())
    fake.finish_launch(handle.data["launch_request"], value=(1, None))
    fake.cluster_up("mrd-r-12")
    fake.jobs[1] = job_state
    return handle


@pytest.mark.parametrize("job_state,state", [
    ("SETTING_UP", "starting"), ("PENDING", "starting"), ("RUNNING", "running"),
    ("FAILED", "failed"), ("FAILED_SETUP", "failed"), ("SUCCEEDED", "failed"),
])
def test_the_vllm_job_decides_whether_an_up_cluster_serves(fake, provider, job_state, state) -> None:  # type: ignore[no-untyped-def]
    status = provider.poll(launched(fake, provider, job_state))
    assert status.state == state, status
    assert ("job_status", [1]) in fake.calls  # the job the launch submitted, not another
    if state == "failed":
        assert job_state in status.message and "sky logs mrd-r-12 1" in status.message
        assert status.error_kind == "other"


def test_an_up_cluster_whose_job_cannot_be_asked_about_is_left_to_readiness(fake, provider) -> None:  # type: ignore[no-untyped-def]
    handle = launched(fake, provider, "RUNNING")
    fake.job_status = None  # type: ignore[assignment,method-assign]
    status = provider.poll(handle)
    assert status.state == "running" and "job state unknown" in status.message


def test_a_failed_launch_reports_its_kind_as_data(fake, provider, sky_exc) -> None:  # type: ignore[no-untyped-def]
    handle = provider.launch(spec())
    fake.finish_launch("req-1", sky_exc.ResourcesUnavailableError(
        "Found no quota for p5.48xlarge on-demand instances in region us-east-1 in AWS."))
    status = provider.poll(handle)
    assert (status.state, status.error_kind) == ("failed", "quota")
    assert "us-east-1" in status.message


def test_a_launch_the_api_server_never_accepted_is_sent_again(fake, provider, sky_exc) -> None:  # type: ignore[no-untyped-def]
    fake.failures_before_launch = [sky_exc.ApiServerConnectionError("http://127.0.0.1:46580")]
    handle = provider.launch(spec())
    assert [c for c in fake.calls if c[0] == "launch"] == [("launch", "mrd-r-12")] * 2
    assert handle.data["launch_request"] in fake.requests


def test_a_launch_refused_for_good_is_not_repeated(fake, provider, sky_exc) -> None:  # type: ignore[no-untyped-def]
    fake.failures_before_launch = [sky_exc.InvalidCloudCredentials("AWS credentials expired")]
    with pytest.raises(ProviderError) as caught:
        provider.launch(spec())
    assert caught.value.kind == "credentials"
    assert [c for c in fake.calls if c[0] == "launch"] == [("launch", "mrd-r-12")]


def test_down_is_repeated_after_transient_errors_and_gives_up_after_the_retries(fake, provider, sky_exc) -> None:  # type: ignore[no-untyped-def]
    handle = launched(fake, provider, "RUNNING")
    fake.failures_before_down = [TimeoutError("read timed out"),
                                 sky_exc.ApiServerConnectionError("http://127.0.0.1:46580")]
    provider.terminate(handle)
    assert "mrd-r-12" not in fake.clusters
    assert [c for c in fake.calls if c[0] == "down"] == [("down", "mrd-r-12")] * 3

    fake.cluster_up("mrd-r-12")
    fake.failures_before_down = [TimeoutError("read timed out")] * 3
    with pytest.raises(ProviderError) as caught:
        provider.terminate(handle)
    assert caught.value.kind == "timeout" and "mrd-r-12" in fake.clusters


def test_offers_are_read_for_every_cloud_the_catalog_ships() -> None:
    shipped = json.loads((REPO_ROOT / "regions" / "catalog" / "catalog.json").read_text())
    skypilot_clouds = {c["skypilot_name"] for c in shipped["clouds"] if c.get("skypilot_name")}
    assert skypilot_clouds <= set(DEFAULT_CLOUDS)


# -- the real SkyPilot catalog, in a child process with its own HOME ---------------------------

LAMBDA_CSV = textwrap.dedent("""\
    InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,Region,GpuInfo,SpotPrice
    gpu_8x_h100_sxm5,H100,8.0,208.0,1800.0,23.92,us-east-1,"{'Gpus': [{'Name': 'H100', 'Manufacturer': 'NVIDIA', 'Count': 8.0, 'MemoryInfo': {'SizeInMiB': 81920}}], 'TotalGpuMemoryInMiB': 81920}",
    gpu_1x_a10,A10,1.0,30.0,200.0,0.75,us-west-1,"{'Gpus': [{'Name': 'A10', 'Manufacturer': 'NVIDIA', 'Count': 1.0, 'MemoryInfo': {'SizeInMiB': 24576}}], 'TotalGpuMemoryInMiB': 24576}",
    """)

OBSERVE = textwrap.dedent("""\
    import json, time
    from controlplane.provisioning.base import ProviderError
    from controlplane.provisioning.skypilot import SkyPilotProvider
    started = time.monotonic()
    try:
        offers = SkyPilotProvider(clouds={"lambda": "lambda"}, timeout_s=120).observe_offers()
        out = {"offers": [[o.cloud, o.region, o.gpu, o.gpus_per_node, o.instance_type,
                           o.on_demand_usd_h, o.spot_usd_h] for o in offers]}
    except ProviderError as exc:
        out = {"kind": exc.kind, "message": exc.message}
    out["elapsed"] = time.monotonic() - started
    print("RESULT " + json.dumps(out))
    """)


def observe_in_child(home: Path) -> dict[str, Any]:
    with socket.socket() as closed:  # a port nobody listens on: the proxy refuses at once
        closed.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{closed.getsockname()[1]}"
    env = {**os.environ, "HOME": str(home), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
           "HTTPS_PROXY": proxy, "HTTP_PROXY": proxy, "https_proxy": proxy,
           "http_proxy": proxy, "NO_PROXY": "", "no_proxy": ""}
    done = subprocess.run([sys.executable, "-c", OBSERVE], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(lines[-1][len("RESULT "):])  # type: ignore[no-any-return]


def test_the_real_catalog_unreachable_is_unavailable_and_quick(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = observe_in_child(tmp_path)
    assert result.get("kind") == "unavailable", result
    assert "lambda" in result["message"].lower() or "catalog" in result["message"].lower()
    # Refused at once rather than waited out: far below the 120 s limit (the bound is
    # generous; the point is that the refusal ends the call, not the time limit).
    assert result["elapsed"] < 60


def test_the_real_catalog_is_read_when_cached(tmp_path) -> None:  # type: ignore[no-untyped-def]
    catalog = tmp_path / ".sky" / "catalogs" / "v8" / "lambda" / "vms.csv"
    catalog.parent.mkdir(parents=True)
    catalog.write_text(LAMBDA_CSV)
    result = observe_in_child(tmp_path)
    assert sorted(result["offers"]) == [
        ["lambda", "us-east-1", "H100", 8, "gpu_8x_h100_sxm5", 23.92, None],
        ["lambda", "us-west-1", "A10", 1, "gpu_1x_a10", 0.75, None],
    ], result
