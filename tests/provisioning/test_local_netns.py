"""A lab region in a network namespace: its engines and relays run inside and answer at its
address, and taking its link down is a partition — connections neither complete nor are
refused — rather than a crash. A malformed MERIDIAN_LAB_NETNS is refused naming the entry."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from controlplane.lab import netns
from controlplane.provisioning.local import LocalProvider
from controlplane.provisioning.local_processes import pid_alive
from controlplane.provisioning.local_regions import LabRegion, RegionNamespace, parse_netns

from .conftest import LAB_REGIONS
from .test_local import spec, wait_running


@pytest.mark.usefixtures("enginesim")
def test_a_namespaced_regions_replica_serves_at_its_address_and_goes_silent_when_cut(
        netns_lab: netns.Lab, state_dir: Path) -> None:
    region = netns_lab.region()
    provider = LocalProvider(state_dir, LAB_REGIONS, engine="enginesim", grace_s=1.0,
                             netns={"local:eu-frankfurt": RegionNamespace(region.name,
                                                                          region.address)})
    handle = provider.launch(spec())
    try:
        wait_running(provider, handle)
        record = provider.read_record(handle.id)
        assert record is not None and record["netns"] == region.name
        assert record["cmdline"][1:3] == ["-m", "enginesim"]  # the program's, not ip's
        url = provider.endpoint(handle, from_region="local:us-virginia")
        assert url is not None and url.startswith(f"http://{region.address}:")
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            assert response.status == 200
        region.partition()
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(TimeoutError):  # not refused, not reset: silence
            socket.create_connection((region.address, port), timeout=1.0).close()
    finally:
        provider.terminate(handle)
    assert not pid_alive(record["pid"]) and not pid_alive(record["relay_pid"])


def test_region_namespaces_are_read_from_their_variable() -> None:
    assert parse_netns("local:eu-frankfurt=mrdnet-1-0@10.213.0.2, local:ap-tokyo=n2@10.0.0.6"
                       ) == {"local:eu-frankfurt": RegionNamespace("mrdnet-1-0", "10.213.0.2"),
                             "local:ap-tokyo": RegionNamespace("n2", "10.0.0.6")}
    assert parse_netns("") == {}
    for bad in ("local:eu-frankfurt", "local:eu-frankfurt=ns", "=ns@10.0.0.1",
                "local:x=ns@"):
        with pytest.raises(ValueError) as refused:
            parse_netns(bad)
        assert "MERIDIAN_LAB_NETNS" in str(refused.value) and repr(bad) in str(refused.value)


def test_a_bare_region_name_finds_its_namespace(state_dir: Path) -> None:
    provider = LocalProvider(state_dir, [LabRegion("local:eu-frankfurt", 50.1, 8.7)],
                             netns={"eu-frankfurt": RegionNamespace("n", "10.213.0.2")})
    assert provider.netns == {"local:eu-frankfurt": RegionNamespace("n", "10.213.0.2")}
