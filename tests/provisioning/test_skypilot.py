"""The SkyPilot adapter: the replica task renders and passes the real SkyPilot's validation for
every shipped offer, bad specs are refused by name, the provider's launch/poll/endpoint/down
flows and error mapping work against a fake SDK, and `render_skypilot_task` prints or refuses.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from io import StringIO
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from controlplane.lab.waiting import wait_until
from controlplane.provisioning.base import (
    ProviderError,
    ProviderHandle,
    ProviderStatus,
    ReplicaSpec,
)
from controlplane.provisioning.skypilot import SkyPilotProvider, error_from_skypilot
from controlplane.provisioning.skypilot_task import (
    cluster_name_for,
    render_replica_task,
    validate_replica_task,
)


@pytest.fixture(scope="module", autouse=True)
def sky_home():  # type: ignore[no-untyped-def]
    """SkyPilot writes under ~/.sky and may phone home: a throwaway HOME, no usage reports."""
    saved = {k: os.environ.get(k) for k in ("HOME", "SKYPILOT_DISABLE_USAGE_COLLECTION")}
    home = tempfile.mkdtemp(prefix="meridian-sky-")
    os.environ["HOME"] = home
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


def spec(**kw: Any) -> ReplicaSpec:
    base: dict[str, Any] = dict(
        replica_id="r-12", deployment="llama", model="meta-llama/Llama-3.1-8B-Instruct",
        served_model_name="llama-3.1-8b", cloud="aws", region="us-east-1",
    )
    base.update(kw)
    return ReplicaSpec(**base)


# -- rendering and validation with the real SkyPilot -----------------------------------------

COMBOS = [
    # cloud, region, accelerator, gpus per node, nodes, tp, pp, spot
    ("aws", "us-east-1", "H100", 8, 1, 8, 1, False),
    ("aws", "eu-central-1", "H100", 1, 1, 1, 1, True),
    ("gcp", "europe-west4", "L4", 1, 1, 1, 1, False),
    ("gcp", "us-central1", "A100-80GB", 4, 1, 2, 2, True),
    ("aws", "us-west-2", "H200", 8, 2, 8, 2, False),  # PP over two nodes
    ("gcp", "us-east4", "H100", 8, 4, 8, 4, True),  # PP over four nodes, spot
    ("lambda", "us-east-1", "A100", 8, 1, 8, 1, False),
    ("runpod", "CA", "MI300X", 8, 1, 8, 1, False),
]


@pytest.mark.parametrize("cloud,region,acc,gpus,nodes,tp,pp,spot", COMBOS)
def test_template_renders_and_validates(cloud, region, acc, gpus, nodes, tp, pp, spot):  # type: ignore[no-untyped-def]
    s = spec(cloud=cloud, region=region, accelerator=acc, gpus_per_node=gpus, nodes=nodes,
             tensor_parallel=tp, pipeline_parallel=pp, use_spot=spot, max_model_len=16384)
    text = render_replica_task(s)
    validate_replica_task(text)
    config = yaml.safe_load(text)
    res = config["resources"]
    assert res["infra"] == f"{cloud}/{region}"
    assert res["accelerators"] == f"{acc}:{gpus}"
    assert res["use_spot"] is spot and res["ports"] == [8000] and res["disk_size"] == 256
    assert config["num_nodes"] == nodes and config["name"] == "mrd-r-12"
    # The key comes as VLLM_API_KEY, which vLLM reads itself: never on its command line.
    assert config["secrets"] == {"VLLM_API_KEY": None, "HF_TOKEN": None}
    assert "pip install vllm==" + s.vllm_version in config["setup"]
    run = config["run"]
    assert ("vllm serve meta-llama/Llama-3.1-8B-Instruct" in run
            and "--served-model-name llama-3.1-8b" in run
            and f"--tensor-parallel-size {tp}" in run and f"--pipeline-parallel-size {pp}" in run
            and "--max-model-len 16384" in run and "--enable-prefix-caching" in run
            and "--port 8000" in run and "--api-key" not in run and "API_KEY" not in run
            and "--ssl-" not in run)
    multi = ("SKYPILOT_NODE_RANK" in run, "SKYPILOT_NODE_IPS" in run,
             "--distributed-executor-backend ray" in run, "ray[default]" in config["setup"])
    assert multi == ((nodes > 1,) * 4)


def test_sky_task_keeps_what_was_rendered(sky_home):  # type: ignore[no-untyped-def]
    import sky

    text = render_replica_task(spec(accelerator="H100", gpus_per_node=8, nodes=2,
                                    tensor_parallel=8, pipeline_parallel=2, use_spot=True))
    task = sky.Task.from_yaml_config(yaml.safe_load(text))
    (res,) = list(task.resources)
    assert (str(res.cloud), res.region, res.accelerators, res.use_spot, res.ports) == (
        "AWS", "us-east-1", {"H100": 8}, True, ["8000"])
    assert task.num_nodes == 2


def test_options_reach_vllm_flags() -> None:
    text = render_replica_task(spec(
        enable_prefix_caching=False, port=9000, env={"VLLM_LOGGING_LEVEL": "DEBUG"},
        disaggregation={"kv_role": "kv_producer", "pip": ["nixl"]}))
    validate_replica_task(text)
    config = yaml.safe_load(text)
    assert "--no-enable-prefix-caching" in config["run"] and "--port 9000" in config["run"]
    assert ("""--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'"""
            in config["run"])
    assert config["envs"]["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert "nixl" in config["setup"] and config["resources"]["ports"] == [9000]
    text = render_replica_task(spec(kv_offload={"size_gib": 64, "backend": "lmcache"}))
    validate_replica_task(text)
    assert "--kv-offloading-size 64 --kv-offloading-backend lmcache" in text
    assert "lmcache" in yaml.safe_load(text)["setup"]
    assert "--kv-" not in render_replica_task(spec())


def test_model_names_are_shell_quoted() -> None:
    text = render_replica_task(spec(served_model_name="x; rm -rf /"))
    validate_replica_task(text)
    assert "--served-model-name 'x; rm -rf /'" in text


def test_every_shipped_offer_renders_and_validates(db) -> None:  # type: ignore[no-untyped-def]
    """All offers of SkyPilot-driven clouds in the shipped catalog (~650, a few ms each)."""
    from django.core.management import call_command

    from regions.models import Offer

    call_command("seed_catalog", verbosity=0)
    offers = Offer.objects.exclude(region__cloud__skypilot_name="").select_related(
        "region__cloud", "gpu_type")
    checked = 0
    for offer in offers:
        s = spec(replica_id=f"r-{offer.pk}", cloud=offer.region.cloud.skypilot_name,
                 region=offer.region.code,
                 accelerator=offer.gpu_type.skypilot_name or offer.gpu_type.name,
                 gpus_per_node=offer.gpus_per_node, tensor_parallel=offer.gpus_per_node,
                 use_spot=offer.spot_usd_h is not None)
        try:
            validate_replica_task(render_replica_task(s))
        except ProviderError as exc:  # pragma: no cover - the message is the point
            pytest.fail(f"{offer}: {exc}")
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("kw,needle", [
    ({"tensor_parallel": 8, "gpus_per_node": 4}, "= 8 GPUs, but 1 node(s) × H100:4 has 4"),
    ({"nodes": 2, "gpus_per_node": 8, "tensor_parallel": 8, "pipeline_parallel": 3},
     "does not split evenly over 2 nodes"),
    ({"region": "us east 1"}, "region 'us east 1'"),
    ({"cloud": "AWS!"}, "cloud 'AWS!'"),
    ({"accelerator": "H100:8"}, "accelerator 'H100:8'"),
    ({"gpus_per_node": 0}, "gpus_per_node must be at least 1"),
    ({"port": 6379}, "port 6379"),
    ({"api_key_env": "bad-name"}, "api_key_env 'bad-name'"),
    ({"vllm_version": "latest"}, "vllm_version 'latest' is not a pinned version"),
    ({"env": {"MERIDIAN_ENGINE_API_KEY": "inline"}}, "env 'MERIDIAN_ENGINE_API_KEY'"),
    ({"disaggregation": {"kv_role": "sender"}}, "kv_role 'sender'"),
    ({"kv_offload": {"size_gib": 0}}, "size_gib must be a positive number"),
    ({"kv_offload": {"size_gib": 8, "backend": "disk"}}, "backend 'disk'"),
    ({"kv_offload": {"size_gib": 8}, "disaggregation": {}}, None),
    ({"kv_offload": {"size_gib": 8}, "disaggregation": {"kv_role": "kv_both"}},
     "use one of them"),
])
def test_invalid_specs_are_refused_by_name(kw, needle) -> None:  # type: ignore[no-untyped-def]
    if needle is None:
        render_replica_task(spec(**kw))
        return
    with pytest.raises(ProviderError) as caught:
        render_replica_task(spec(**kw))
    assert caught.value.kind == "invalid" and needle in caught.value.message


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.replace("disk_size: 256", "disk_size: -1"), "disk_size"),
    (lambda t: t.replace("    - 8000", "    - 99999"), "Invalid port 99999"),
    (lambda t: t.replace('"H100:1"', '"H100:0"'), "Accelerator count must be a positive"),
    (lambda t: t.replace("num_nodes: 1", "num_nodes: 0"), "num_nodes"),
    (lambda t: t.replace('infra: "aws/us-east-1"', 'infra: "nocloud/x"'), "Invalid resources"),
    (lambda t: t + "bogus: 1\n", "unsupported field 'bogus'"),
    (lambda t: t.replace('infra: "aws/us-east-1"', 'infra: "aws"'), "lack region"),
    (lambda t: t.replace("exec vllm serve", "exec python -m http.server"), "vllm serve"),
    (lambda t: "resources: [", "not valid YAML"),
    (lambda t: "- a\n- b\n", "not a mapping"),
])
def test_validation_names_what_is_wrong(edit, needle) -> None:  # type: ignore[no-untyped-def]
    text = edit(render_replica_task(spec()))
    with pytest.raises(ProviderError) as caught:
        validate_replica_task(text)
    assert caught.value.kind == "invalid" and needle in caught.value.message


def test_cluster_names() -> None:
    assert cluster_name_for("r-12") == "mrd-r-12"
    assert cluster_name_for("R_7/x") == "mrd-r-7-x"
    assert len(cluster_name_for("r-" + "9" * 80)) <= 40


# -- the provider against a fake SDK ----------------------------------------------------------

class FakeSky:
    """SkyPilot's request-ID SDK as the provider uses it: requests finish when told to.

    Where it can, it answers as the real SDK and API server do (tests/provisioning/
    test_skypilot_server.py drives the real ones): `get` waits while a request is pending or
    running, raises the request's error, raises RequestCancelled for a cancelled one and
    RuntimeError for an unknown id; `status` leaves out clusters it does not know; `down`
    of such a cluster fails with ClusterDoesNotExist, `endpoints` with ClusterNotUpError;
    `api_cancel` cancels only requests still pending or running and its own result is the
    list of the ids it cancelled.
    """

    StatusRefreshMode = SimpleNamespace(AUTO="AUTO", NONE="NONE")
    ACTIVE = ("PENDING", "RUNNING")
    GET_WAIT_S = 30.0  # a fake request nobody finishes ends here, not never

    def __init__(self) -> None:
        import sky

        self.Task = sky.Task
        self.requests: dict[str, dict[str, Any]] = {}
        self.clusters: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, Any]] = []
        self.launch_error: BaseException | None = None
        # A stalled launch or catalog call returns only once `release` is set (the test is
        # done with it, or GET_WAIT_S passed): a time limit that works never waits for it.
        self.release = threading.Event()
        self.launch_stalls = False
        self.api_error: BaseException | None = None
        self.endpoints_map: dict[int, str] | None = None
        self.catalog = SimpleNamespace(list_accelerators=self._list_accelerators)
        self.catalog_result: dict[str, list[Any]] | BaseException = {}
        self.catalog_stalls = False
        self.held: set[str] = set()  # request names that stay RUNNING until released
        # As on the real server, a cancel may wait in the short-request queue: with this set,
        # api_cancel is accepted at once and takes effect only at process_cancels().
        self.cancels_queued = False
        self.queued_cancels: list[str] = []
        self._changed = threading.Condition()

    def _request(self, name: str, value: Any = None, error: BaseException | None = None,
                 status: str = "SUCCEEDED") -> str:
        with self._changed:
            rid = f"req-{len(self.requests) + 1}"
            if name in self.held:
                status = "RUNNING"
            elif error is not None:
                status = "FAILED"
            self.requests[rid] = {"name": name, "status": status, "value": value,
                                  "error": error}
        return rid

    def launch(self, task: Any, cluster_name: str, **kw: Any) -> str:
        self.calls.append(("launch", cluster_name))
        if self.launch_stalls:
            self.release.wait(self.GET_WAIT_S)
        if self.launch_error is not None:
            raise self.launch_error
        self.task = task
        return self._request("launch", status="RUNNING")

    def api_status(self, request_ids: list[str]) -> list[Any]:
        if self.api_error is not None:
            raise self.api_error
        return [SimpleNamespace(request_id=r, status=self.requests[r]["status"])
                for r in request_ids if r in self.requests]

    def get(self, rid: str) -> Any:
        import sky.exceptions

        with self._changed:
            if rid not in self.requests:
                raise RuntimeError(f"Failed to get request {rid}: 404 "
                                   f'{{"detail":"Request {rid!r} not found"}}')
            req = self.requests[rid]
            if not self._changed.wait_for(lambda: req["status"] not in self.ACTIVE,
                                          timeout=self.GET_WAIT_S):
                raise TimeoutError(f"fake request {rid} was never finished")
        if req["status"] == "CANCELLED":
            raise sky.exceptions.RequestCancelled(
                f"Current {req['name']!r} request ({rid}) is cancelled by another process.")
        if req["error"] is not None:
            raise req["error"]
        return req["value"]

    def status(self, cluster_names: list[str] | None = None, refresh: Any = None) -> str:
        self.calls.append(("status", refresh))
        if self.api_error is not None:
            raise self.api_error
        names = cluster_names if cluster_names is not None else list(self.clusters)
        return self._request("status", [dict(self.clusters[n]) for n in names
                                        if n in self.clusters])

    def endpoints(self, cluster: str, port: int | None = None) -> str:
        import sky.exceptions

        if cluster not in self.clusters:
            return self._request("endpoints", error=sky.exceptions.ClusterNotUpError(
                f"Cluster {cluster!r} not found."))
        if self.endpoints_map is None:
            return self._request("endpoints", error=ValueError("endpoint not exposed"))
        return self._request("endpoints", self.endpoints_map)

    def down(self, cluster: str) -> str:
        self.calls.append(("down", cluster))
        if cluster not in self.clusters:
            import sky.exceptions

            return self._request("down", error=sky.exceptions.ClusterDoesNotExist(
                f"Cluster {cluster!r} does not exist."))
        del self.clusters[cluster]
        return self._request("down")

    def api_cancel(self, request_ids: str | list[str] | None = None, all_users: bool = False,
                   silent: bool = False) -> str:
        rids = [request_ids] if isinstance(request_ids, str) else list(request_ids or [])
        cancelled = []
        with self._changed:
            for rid in rids:
                self.calls.append(("cancel", rid))
                if self.cancels_queued:
                    self.queued_cancels.append(rid)
                    continue
                if rid in self.requests and self.requests[rid]["status"] in self.ACTIVE:
                    self.requests[rid]["status"] = "CANCELLED"
                    cancelled.append(rid)
            self._changed.notify_all()
        return self._request("cancel", cancelled)

    def _list_accelerators(self, **kw: Any) -> dict[str, list[Any]]:
        self.calls.append(("catalog", kw["clouds"]))
        if self.catalog_stalls:
            self.release.wait(self.GET_WAIT_S)
        if isinstance(self.catalog_result, BaseException):
            raise self.catalog_result
        return self.catalog_result if kw["clouds"] == "aws" else {}

    # test helpers
    def process_cancels(self) -> None:
        """The queued cancels run: what is still pending or running ends cancelled."""
        with self._changed:
            for rid in self.queued_cancels:
                if self.requests[rid]["status"] in self.ACTIVE:
                    self.requests[rid]["status"] = "CANCELLED"
            self.queued_cancels.clear()
            self.calls.append(("cancels processed", None))
            self._changed.notify_all()

    def finish_launch(self, rid: str, error: BaseException | None = None,
                      value: Any = None) -> None:
        with self._changed:
            self.requests[rid].update(status="FAILED" if error else "SUCCEEDED", error=error,
                                      value=value)
            self._changed.notify_all()

    def cluster_up(self, name: str, status: str = "UP", head_ip: str = "3.4.5.6",
                   **extra: Any) -> None:
        self.clusters[name] = {"name": name, "status": status,
                               "handle": SimpleNamespace(head_ip=head_ip), **extra}


@pytest.fixture
def fake(sky_home):  # type: ignore[no-untyped-def]
    sdk = FakeSky()
    yield sdk
    sdk.release.set()


@pytest.fixture
def provider(fake):  # type: ignore[no-untyped-def]
    return SkyPilotProvider(sdk=fake, timeout_s=2.0,
                            environ={"MERIDIAN_ENGINE_API_KEY": "sk-engine-secret"})


def test_a_replica_with_mtls_gets_its_own_key_and_certificate_as_secrets(  # type: ignore[no-untyped-def]
        fake, provider, tmp_path) -> None:
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text(f"-----PEM {name}-----")
    secured = spec(engine_key="sk-engine-r-12-own", tls_dir=str(tmp_path))
    text = render_replica_task(secured)
    validate_replica_task(text)
    config = yaml.safe_load(text)
    assert set(config["secrets"]) == {"VLLM_API_KEY", "HF_TOKEN", "MERIDIAN_TLS_CERT",
                                      "MERIDIAN_TLS_KEY", "MERIDIAN_TLS_CA"}
    run = config["run"]
    assert ("--ssl-cert-reqs 2" in run and "--ssl-keyfile .meridian-tls/key.pem" in run
            and "umask 077" in run and "--enable-ssl-refresh" in run)
    assert "PEM" not in text and "sk-engine" not in text  # values only as secrets
    provider.launch(secured)
    secrets = {k: v.get_secret_value() for k, v in fake.task.secrets.items()}
    assert secrets["VLLM_API_KEY"] == "sk-engine-r-12-own"  # not the fleet's
    assert secrets["MERIDIAN_TLS_KEY"] == "-----PEM key.pem-----"
    (tmp_path / "key.pem").unlink()
    with pytest.raises(ProviderError) as caught:
        provider.launch(spec(replica_id="r-13", engine_key="k", tls_dir=str(tmp_path)))
    assert caught.value.kind == "credentials" and "TLS files" in caught.value.message


def test_launch_poll_endpoint_terminate(fake, provider) -> None:  # type: ignore[no-untyped-def]
    handle = provider.launch(spec(use_spot=True))
    assert handle.provider == "skypilot" and handle.id == "r-12"
    assert handle.data["cluster"] == "mrd-r-12" and handle.data["launch_request"] == "req-1"
    assert fake.calls[0] == ("launch", "mrd-r-12")
    assert fake.task.secrets["VLLM_API_KEY"].get_secret_value() == "sk-engine-secret"
    assert "sk-engine-secret" not in render_replica_task(spec())
    assert provider.poll(handle).state == "provisioning"
    fake.cluster_up("mrd-r-12", status="INIT")
    assert provider.poll(handle).state == "provisioning"
    fake.cluster_up("mrd-r-12")
    assert provider.poll(handle).state == "starting"
    fake.finish_launch("req-1")
    status = provider.poll(handle)
    assert status.state == "running" and "mrd-r-12" in status.message
    assert ("status", "AUTO") in fake.calls  # spot preemption is refreshed from the cloud
    assert provider.endpoint(handle) == "http://3.4.5.6:8000"  # from the status handle
    fake.endpoints_map = {8000: "3.4.5.7:8000"}
    assert provider.endpoint(handle) == "http://3.4.5.7:8000"
    provider.terminate(handle)
    assert ("down", "mrd-r-12") in fake.calls
    assert provider.poll(handle).state == "terminated"
    provider.terminate(handle)  # already gone: harmless
    assert provider.endpoint(handle) is None


def test_terminate_cancels_a_launch_in_flight(fake, provider) -> None:  # type: ignore[no-untyped-def]
    handle = provider.launch(spec())
    provider.terminate(handle)
    assert ("cancel", "req-1") in fake.calls and ("down", "mrd-r-12") in fake.calls
    assert provider.poll(handle).state == "terminated"


def test_terminate_waits_until_a_queued_cancel_has_ended_the_launch(fake, provider) -> None:  # type: ignore[no-untyped-def]
    """The real server queues a cancel behind its other short requests: terminate takes the
    cluster down only once the launch shows it has ended, never while it could still bring
    the cluster up."""
    fake.cancels_queued = True
    handle = provider.launch(spec())

    def server() -> None:  # runs the queued cancel once terminate has asked for it
        wait_until(lambda: fake.queued_cancels, 30, "terminate's cancel of the launch")
        fake.process_cancels()

    worker = threading.Thread(target=server)
    worker.start()
    provider.terminate(handle)
    worker.join()
    calls = [name for name, _ in fake.calls]
    assert calls.index("cancels processed") < calls.index("down")
    assert fake.requests["req-1"]["status"] == "CANCELLED"
    assert provider.poll(handle).state == "terminated"


def test_terminate_does_not_take_down_while_the_launch_still_runs(fake) -> None:  # type: ignore[no-untyped-def]
    """A cancel that never runs: the launch could still bring the cluster up, so terminate
    fails as a timeout (to be tried again) and sends no down that would find nothing."""
    fake.cancels_queued = True
    provider = SkyPilotProvider(sdk=fake, timeout_s=0.3, retry_backoff_s=0.0,
                                environ={"MERIDIAN_ENGINE_API_KEY": "k"})
    handle = provider.launch(spec())
    with pytest.raises(ProviderError) as caught:
        provider.terminate(handle)
    assert caught.value.kind == "timeout"
    assert "launch request req-1 is still running" in caught.value.message
    assert ("cancel", "req-1") in fake.calls
    assert not [call for call in fake.calls if call[0] == "down"]
    fake.process_cancels()  # the server gets to it at last: terminate now completes
    provider.terminate(handle)
    assert ("down", "mrd-r-12") in fake.calls


def test_cluster_states_after_launch(fake, provider) -> None:  # type: ignore[no-untyped-def]
    handle = provider.launch(spec())
    fake.finish_launch("req-1")
    fake.cluster_up("mrd-r-12", status="STOPPED")
    assert provider.poll(handle).state == "failed"
    fake.cluster_up("mrd-r-12", status="INIT", init_kind="unhealthy",
                    init_status_reason="node terminated")
    status = provider.poll(handle)
    assert status.state == "failed" and "node terminated" in status.message


@pytest.mark.parametrize("make,kind,words", [
    (lambda e: e.ResourcesUnavailableError("Failed to acquire resources in all zones of "
                                           "us-east-1 for {AWS(p5.48xlarge)}."),
     "no_capacity", "Failed to acquire"),
    (lambda e: e.ResourcesUnavailableError("Failed to provision all possible launchable "
                                           "resources.", failover_history=[RuntimeError(
                                               "VcpuLimitExceeded: You have requested more "
                                               "vCPU capacity than your current vCPU limit")]),
     "quota", "Failed to provision"),
    (lambda e: e.ResourcesUnavailableError("Found no quota for p5.48xlarge in us-east-1."),
     "quota", "no quota"),
    (lambda e: e.ResourcesUnavailableError("Task requires AWS which is not enabled. To enable "
                                           "access, run: sky check aws"),
     "credentials", "not enabled"),
    # What SkyPilot's API server raises when no cloud is enabled (test_skypilot_server.py).
    (lambda e: e.NoCloudAccessError("Cloud access is not set up. Run: \x1b[1msky check\x1b[0m"),
     "credentials", "Cloud access is not set up. Run: sky check"),
    (lambda e: e.InvalidCloudCredentials("AWS credentials are not set."), "credentials",
     "credentials"),
    (lambda e: e.CloudUserIdentityError("Failed to get AWS user identity"), "credentials",
     "identity"),
    (lambda e: TimeoutError("provisioning timed out"), "timeout", "timed out"),
    (lambda e: e.ApiServerConnectionError("http://127.0.0.1:46580"), "unavailable", ""),
    (lambda e: RuntimeError("boom"), "other", "boom"),
])
def test_failed_launch_maps_to_kind(fake, provider, sky_exc, make, kind, words) -> None:  # type: ignore[no-untyped-def]
    handle = provider.launch(spec())
    fake.finish_launch("req-1", make(sky_exc))
    status = provider.poll(handle)
    assert status.state == "failed" and status.message.startswith(f"{kind}: ")
    assert words in status.message


def test_launch_refusals_raise_provider_errors(fake, provider, sky_exc) -> None:  # type: ignore[no-untyped-def]
    fake.launch_error = sky_exc.InvalidCloudCredentials("GCP credentials expired")
    with pytest.raises(ProviderError) as caught:
        provider.launch(spec())
    assert caught.value.kind == "credentials" and "GCP credentials expired" in str(caught.value)
    fake.launch_error = sky_exc.ApiServerConnectionError("http://127.0.0.1:46580")
    with pytest.raises(ProviderError) as caught:
        provider.launch(spec())
    assert caught.value.kind == "unavailable"
    no_key = SkyPilotProvider(sdk=fake, environ={})
    with pytest.raises(ProviderError) as caught:
        no_key.launch(spec())
    assert caught.value.kind == "credentials" and "MERIDIAN_ENGINE_API_KEY" in caught.value.message
    with pytest.raises(ProviderError) as caught:
        provider.launch(spec(tensor_parallel=2))
    assert caught.value.kind == "invalid"


def test_calls_are_time_bounded(fake, sky_home) -> None:  # type: ignore[no-untyped-def]
    provider = SkyPilotProvider(sdk=fake, timeout_s=0.2,
                                environ={"MERIDIAN_ENGINE_API_KEY": "k"})
    fake.launch_stalls = True  # until released below: only the time limit ends the wait
    with pytest.raises(ProviderError) as caught:
        provider.launch(spec())
    assert caught.value.kind == "timeout"
    assert "cancelled once the API server accepts it" in caught.value.message
    # The submission that overran comes back with its request id: that launch is cancelled.
    fake.release.set()
    wait_until(lambda: fake.requests.get("req-1", {}).get("status") == "CANCELLED", 30,
               "the overrun launch cancelled on the API server")
    assert ("cancel", "req-1") in fake.calls
    handle = ProviderHandle("skypilot", "r-12", {"cluster": "mrd-r-12", "launch_request": "x"})
    fake.api_error = TimeoutError("read timed out")
    status = provider.poll(handle)
    assert status.state == "unknown" and status.message.startswith("timeout: ")


def test_a_request_that_overruns_is_cancelled_on_the_api_server(fake, sky_home) -> None:  # type: ignore[no-untyped-def]
    # Held requests overrun whatever the limit; the limit is 1 s so that accepting a request
    # and cancelling it, which the fake does at once, fit in it on a loaded machine too.
    provider = SkyPilotProvider(sdk=fake, timeout_s=1.0, retry_backoff_s=0.0,
                                environ={"MERIDIAN_ENGINE_API_KEY": "k"})
    handle = ProviderHandle("skypilot", "r-12", {"cluster": "mrd-r-12"})
    fake.cluster_up("mrd-r-12")
    fake.held = {"status"}  # the status request is accepted, and then nothing comes back
    status = provider.poll(handle)
    assert status.state == "unknown" and status.message.startswith("timeout: ")
    (rid,) = [r for r, req in fake.requests.items() if req["name"] == "status"]
    assert f"request {rid} cancelled" in status.message
    wait_until(lambda: fake.requests[rid]["status"] == "CANCELLED", 30,
               f"status request {rid} cancelled on the API server")
    assert ("cancel", rid) in fake.calls
    fake.held = {"down"}  # every try at down overruns: each is cancelled before the next
    with pytest.raises(ProviderError) as caught:
        provider.terminate(handle)
    assert caught.value.kind == "timeout"
    downs = [r for r, req in fake.requests.items() if req["name"] == "down"]
    assert len(downs) == 3
    wait_until(lambda: {fake.requests[r]["status"] for r in downs} == {"CANCELLED"}, 30,
               "every try at down cancelled")


def test_unreachable_api_server_is_unknown_not_failed(fake, provider, sky_exc) -> None:  # type: ignore[no-untyped-def]
    handle = provider.launch(spec())
    fake.api_error = sky_exc.ApiServerConnectionError("http://127.0.0.1:46580")
    status = provider.poll(handle)
    assert status.state == "unknown" and status.message.startswith("unavailable: ")


def test_error_mapping_of_transport_errors() -> None:
    import requests

    assert error_from_skypilot(requests.ReadTimeout("read timed out")).kind == "timeout"
    assert error_from_skypilot(requests.ConnectionError("refused")).kind == "unavailable"
    assert error_from_skypilot(ValueError("bad"), "launch").message == "launch: bad"


def test_observe_offers_reads_the_catalog(fake, provider) -> None:  # type: ignore[no-untyped-def]
    from sky.catalog.common import InstanceTypeInfo

    fake.catalog_result = {
        "H100": [InstanceTypeInfo("AWS", "p5.48xlarge", "H100", 8, 192, 80, 2048, 55.04,
                                  23.1, "us-east-1"),
                 InstanceTypeInfo("AWS", "p5.48xlarge", "H100", 8, 192, 80, 2048, 55.04,
                                  float("nan"), "eu-central-1")],
        "T4": [InstanceTypeInfo("AWS", None, "T4", 0.5, None, None, None, 0.1, 0.0, "x")],
    }
    seen = provider.observe_offers()
    assert [(o.cloud, o.region, o.gpu, o.gpus_per_node, o.instance_type, o.on_demand_usd_h,
             o.spot_usd_h, o.source) for o in seen] == [
        ("aws", "us-east-1", "H100", 8, "p5.48xlarge", 55.04, 23.1, "skypilot-catalog"),
        ("aws", "eu-central-1", "H100", 8, "p5.48xlarge", 55.04, None, "skypilot-catalog"),
    ]
    assert ("catalog", "gcp") in fake.calls
    only_l4 = SkyPilotProvider(sdk=fake, gpus={"L4"})
    assert only_l4.observe_offers() == []


def test_observe_offers_offline_is_unavailable_and_quick(fake, sky_home) -> None:  # type: ignore[no-untyped-def]
    import requests

    provider = SkyPilotProvider(sdk=fake, timeout_s=0.3)
    fake.catalog_result = requests.ConnectionError("Failed to resolve raw.githubusercontent.com")
    with pytest.raises(ProviderError) as caught:
        provider.observe_offers()
    assert caught.value.kind == "unavailable"
    fake.catalog_result = {}
    fake.catalog_stalls = True  # answers only when the test ends: the time limit ends the wait
    with pytest.raises(ProviderError) as caught:
        provider.observe_offers()
    assert caught.value.kind == "unavailable"


def test_adopt_or_reap(fake, provider) -> None:  # type: ignore[no-untyped-def]
    for name in ("mrd-r-1", "mrd-r-2", "someone-elses"):
        fake.cluster_up(name)
    adopted, reaped = provider.adopt_or_reap({"r-1", "r-9"})
    assert (adopted, reaped) == (["r-1"], ["r-2"])
    assert sorted(fake.clusters) == ["mrd-r-1", "someone-elses"]


def test_no_api_server_was_started() -> None:
    """Rendering and validating must not have started SkyPilot's API server daemon."""
    mine = os.environ["HOME"]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read()
        except OSError:
            continue
        if "sky.server.server" in cmdline:
            assert f"HOME={mine}".encode() not in environ, cmdline
    assert threading.active_count() < 50


# -- the management command -------------------------------------------------------------------

@pytest.fixture
def deployment(catalog):  # type: ignore[no-untyped-def]
    from controlplane.deployments.models import Deployment, Model

    d = Deployment.objects.create(name="chat", served_model_name="llama-3.1-8b",
                                  model=catalog["llama8b"], max_model_len=8192)
    big = Model.objects.create(
        name="llama-3.1-70b-instruct", hf_id="meta-llama/Llama-3.1-70B-Instruct",
        family="llama", parameters_b=70.6, layers=80, hidden_size=8192, attention_heads=64,
        kv_heads=8, head_dim=128, max_context=131072)
    Deployment.objects.create(name="big", served_model_name="llama-70b", model=big)
    Deployment.objects.create(name="big-pp", served_model_name="llama-70b", model=big,
                              tensor_parallel=1, pipeline_parallel=2)
    return d


def run_command(*args: str) -> str:
    from django.core.management import call_command

    out = StringIO()
    call_command("render_skypilot_task", *args, stdout=out)
    return out.getvalue()


def test_command_prints_valid_yaml(deployment) -> None:  # type: ignore[no-untyped-def]
    text = run_command("chat", "--region", "aws:eu-central-1", "--gpu", "H100:1", "--spot")
    validate_replica_task(text)
    config = yaml.safe_load(text)
    assert config["resources"] == {"infra": "aws/eu-central-1", "accelerators": "H100:1",
                                   "use_spot": True, "disk_size": 256, "ports": [8000]}
    assert "vllm serve meta-llama/Llama-3.1-8B-Instruct" in config["run"]
    assert "--served-model-name llama-3.1-8b" in config["run"]


def test_command_pipelines_over_nodes(deployment, catalog) -> None:  # type: ignore[no-untyped-def]
    from controlplane.deployments.models import Deployment

    Deployment.objects.filter(name="big-pp").update(tensor_parallel=1, pipeline_parallel=4)
    config = yaml.safe_load(run_command("big-pp", "--region", "gcp:europe-west4",
                                        "--gpu", "H100:1"))
    assert config["num_nodes"] == 4 and "--pipeline-parallel-size 4" in config["run"]


@pytest.mark.parametrize("args,needle", [
    (("nope", "--region", "aws:us-east-1", "--gpu", "H100:1"), "unknown deployment 'nope'"),
    (("chat", "--region", "aws:mars-1", "--gpu", "H100:1"), "unknown region 'aws:mars-1'"),
    (("chat", "--region", "us-east-1", "--gpu", "H100:1"), "use CLOUD:REGION"),
    (("chat", "--region", "aws:us-east-1", "--gpu", "TPU:1"), "unknown GPU 'TPU'"),
    (("chat", "--region", "aws:us-east-1", "--gpu", "H100:x"), "whole number"),
    (("chat", "--region", "aws:us-east-1", "--gpu", "H100:8"),
     "aws:us-east-1 has no offer of H100:8 (offers there: H100:1, L4:1)"),
    (("chat", "--region", "aws:us-east-1", "--gpu", "L4:1", "--spot"), "no spot price"),
    (("big", "--region", "aws:us-east-1", "--gpu", "H100:1"),
     "does not fit on 1 × H100"),
    (("big-pp", "--region", "aws:us-east-1", "--gpu", "L4:1"), "does not fit on 2 × L4"),
])
def test_command_refuses_clearly(deployment, args, needle) -> None:  # type: ignore[no-untyped-def]
    from django.core.management.base import CommandError

    with pytest.raises(CommandError) as caught:
        run_command(*args)
    assert needle in str(caught.value)


def test_command_refuses_tp_wider_than_a_node(deployment) -> None:  # type: ignore[no-untyped-def]
    from django.core.management.base import CommandError

    from controlplane.deployments.models import Deployment

    Deployment.objects.filter(name="chat").update(tensor_parallel=2)
    with pytest.raises(CommandError, match="tensor_parallel 2 needs 2 GPUs on one node"):
        run_command("chat", "--region", "aws:us-east-1", "--gpu", "H100:1")


def test_command_refuses_clouds_not_driven_by_skypilot(deployment, catalog) -> None:  # type: ignore[no-untyped-def]
    from django.core.management.base import CommandError

    catalog["aws"].skypilot_name = ""
    catalog["aws"].save()
    with pytest.raises(CommandError, match="not driven by SkyPilot"):
        run_command("chat", "--region", "aws:us-east-1", "--gpu", "H100:1")


def test_command_exits_non_zero_from_the_shell(deployment) -> None:  # type: ignore[no-untyped-def]
    """CommandError through manage.py's entry point is exit status 1 with the message."""
    from django.core.management import ManagementUtility

    err = StringIO()
    utility = ManagementUtility(["manage.py", "render_skypilot_task", "nope", "--region",
                                 "aws:us-east-1", "--gpu", "H100:1"])
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as caught:
        utility.execute()
    assert caught.value.code == 1 and "unknown deployment 'nope'" in err.getvalue()


# -- opt-in: a real cluster --------------------------------------------------------------------

@pytest.mark.cloud
@pytest.mark.skipif(os.environ.get("MERIDIAN_SKYPILOT_SMOKE") != "1",
                    reason="set MERIDIAN_SKYPILOT_SMOKE=1 (and cloud credentials) to launch")
def test_smoke_real_cluster() -> None:  # pragma: no cover - needs a cloud account
    """Launch one small replica for real, wait for its endpoint, and tear it down."""
    cloud, _, region = os.environ.get("MERIDIAN_SKYPILOT_REGION", "aws:us-east-1").partition(":")
    gpu = os.environ.get("MERIDIAN_SKYPILOT_GPU", "L4")
    provider = SkyPilotProvider(timeout_s=120)
    s = spec(replica_id=f"r-smoke-{int(time.time())}", model="Qwen/Qwen2.5-0.5B-Instruct",
             served_model_name="smoke", cloud=cloud, region=region, accelerator=gpu,
             use_spot=False, disk_gb=100)
    handle = provider.launch(s)
    try:
        def ended() -> ProviderStatus | None:
            status = provider.poll(handle)
            return status if status.state in ("running", "failed", "terminated") else None

        status = wait_until(ended, 3600, "the cluster up or ended", every_s=20)
        assert status.state == "running", status
        assert (provider.endpoint(handle) or "").startswith("http://")
    finally:
        provider.terminate(handle)
        try:
            import sky

            sky.api_stop()
        except Exception:
            pass


@pytest.mark.django_db
def test_the_scheduled_reaper_takes_down_clusters_no_live_replica_owns(  # type: ignore[no-untyped-def]
        fake, provider, catalog):
    from controlplane.core.models import AuditLog
    from controlplane.deployments.models import Deployment, Replica
    from controlplane.deployments.models import ReplicaState as S
    from controlplane.provisioning import services

    # Never launched through SkyPilot: nothing is asked of it.
    assert services.reap_cloud_clusters() == {"adopted": [], "reaped": []}
    assert fake.calls == []
    d = Deployment.objects.create(name="d", served_model_name="m", model=catalog["llama8b"])
    live = Replica.objects.create(deployment=d, region=catalog["fra"], provider="skypilot",
                                  state=S.READY)
    gone = Replica.objects.create(deployment=d, region=catalog["fra"], provider="skypilot",
                                  state=S.TERMINATED)
    for replica in (live, gone):
        fake.cluster_up(f"mrd-{replica.public_id}")
    fake.cluster_up("someone-elses")
    services.set_provider("skypilot", provider)
    try:
        result = services.reap_cloud_clusters()
    finally:
        services.set_provider("skypilot", None)
    assert result == {"adopted": [live.public_id], "reaped": [gone.public_id]}
    assert sorted(fake.clusters) == [f"mrd-{live.public_id}", "someone-elses"]
    assert AuditLog.objects.filter(action="provisioning.reap").exists()
