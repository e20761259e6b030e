"""LocalProvider with a real vLLM (CPU build): an engine that cannot start fails its replica
with the engine's own last log lines, and nothing is left running."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controlplane.lab.waiting import wait_until
from controlplane.provisioning.base import ReplicaSpec
from controlplane.provisioning.local import LocalProvider
from controlplane.provisioning.local_processes import runs
from tests.real_engine import require_engine

pytestmark = [pytest.mark.e2e, pytest.mark.real_engine]


def test_a_vllm_that_cannot_start_fails_with_its_last_log_lines(local_provider) -> None:  # type: ignore[no-untyped-def]
    require_engine()
    provider = LocalProvider(local_provider.state_dir, local_provider.lab_regions,
                             grace_s=2.0)
    spec = ReplicaSpec(replica_id="r-missing", deployment="demo-chat",
                       model="meridian-test/no-such-model", served_model_name="missing",
                       cloud="local", region="eu-frankfurt", max_model_len=2048)
    handle = provider.launch(replace(spec, engine="vllm"))
    record = provider.read_record(handle.id)
    assert record is not None and record["engine"] == "vllm" and record["core"] is not None
    status = wait_until(lambda: s if (s := provider.poll(handle)).state != "starting" else None,
                        180, "the launch past starting", every_s=0.5)
    assert status.state == "failed", status
    # vLLM's own words, from its log: offline, the model is nowhere to be found.
    assert "log ends:" in status.message
    assert "LocalEntryNotFoundError" in status.message, status.message
    provider.terminate(handle)
    assert not runs(record) and not runs(record, "relay_")
