"""What a plan sizes and prices is what provisioning launches: the deployment's TP × PP, on
the nodes the plan chose, at the $/h the plan counted."""

from __future__ import annotations

from decimal import Decimal

import pytest
import yaml

from controlplane.costs.services import usd_h_for
from controlplane.deployments.models import Replica
from controlplane.plans import apply as plans
from controlplane.placement.capacity import GpuSpec, replica_shape
from controlplane.placement.models import ChangeAction, PlanStatus
from controlplane.placement.proposals import model_spec, propose_plan
from controlplane.provisioning.local import LocalProvider
from controlplane.provisioning.services import spec_for
from controlplane.provisioning.skypilot import render_replica_task
from regions.models import Offer
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def tp2(catalog, tenants):  # type: ignore[no-untyped-def]
    """chat-eu with TP 2 at 4,096 tokens. The catalog's cheap nodes have one GPU each, which
    cannot hold a TP group of two; a 4×L4 node in Eemshaven can (two of its GPUs idle)."""
    d = make_deployment({**catalog, **tenants}, "chat-eu")
    d.min_replicas, d.max_replicas = 2, 4
    d.tensor_parallel, d.max_model_len = 2, 4096
    d.save()
    l4x4 = Offer.objects.create(region=catalog["ams"], gpu_type=catalog["l4"], gpus_per_node=4,
                                instance_type="g2-standard-48", on_demand_usd_h=Decimal("3.20"),
                                observed_at=catalog["fra"].offers.first().observed_at)
    return d, l4x4


def test_a_plan_never_uses_nodes_the_deployments_engine_cannot_run_on(tp2):  # type: ignore[no-untyped-def]
    d, l4x4 = tp2
    plan = propose_plan([d], actor="tester", trigger="test")
    assert plan.status == PlanStatus.PROPOSED, plan.explanation
    adds = list(plan.changes.filter(action=ChangeAction.ADD))
    assert sum(c.count for c in adds) == 2
    # Every single-GPU offer is cheaper per node, and none can hold TP 2.
    assert {c.offer_id for c in adds} == {l4x4.pk}
    assert all("(tp 2; 2 of 4 GPUs idle)" in c.reason for c in adds)


def test_the_launched_spec_is_the_planned_shape(tp2, sent_tasks):  # type: ignore[no-untyped-def]
    d, l4x4 = tp2
    plan = propose_plan([d], actor="tester", trigger="test")
    plans.approve(plan.pk, "tester")
    plans.start_apply(plan.pk, "tester")
    replicas = list(Replica.objects.filter(deployment=d).select_related(
        "deployment__model", "region__cloud", "offer__gpu_type"))
    assert len(replicas) == 2
    l4 = l4x4.gpu_type
    shape = replica_shape(model_spec(d), GpuSpec(l4.name, l4.memory_gib, l4.memory_bandwidth_gbps),
                          4, 4096, tensor_parallel=2, pipeline_parallel=1)
    assert shape is not None
    (change,) = plan.changes.filter(action=ChangeAction.ADD)
    for replica in replicas:
        spec = spec_for(replica)
        assert (spec.accelerator, spec.gpus_per_node, spec.nodes) == ("L4", 4, shape.nodes)
        assert (spec.tensor_parallel, spec.pipeline_parallel) == (
            shape.tensor_parallel, shape.pipeline_parallel)
        # The plan's $/h is what the replica is billed at.
        assert change.usd_h_delta / change.count == usd_h_for(l4x4, False, 2, 1)
        assert f"~{shape.tokens_per_s:,.0f} tok/s" in change.reason
        # SkyPilot is asked for exactly those nodes and that engine; so is a local vLLM.
        task = yaml.safe_load(render_replica_task(spec))
        assert task["resources"]["accelerators"] == "L4:4" and task["num_nodes"] == 1
        assert "--tensor-parallel-size 2" in task["run"]
        assert "--pipeline-parallel-size 1" in task["run"]
        argv = LocalProvider("/nonexistent", []).engine_argv(spec, 8000, kind="vllm")
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
        assert argv[argv.index("--pipeline-parallel-size") + 1] == "1"


def test_a_pipelined_engine_is_planned_and_launched_over_several_nodes(catalog, tenants,  # type: ignore[no-untyped-def]
                                                                      sent_tasks):
    # 8B at 8,192 tokens × 32 sequences needs three L4s: PP 3 over three single-L4 nodes.
    d = make_deployment({**catalog, **tenants}, "chat-eu")
    d.min_replicas, d.max_replicas, d.pipeline_parallel = 1, 1, 3
    d.save()
    plan = propose_plan([d], actor="tester", trigger="test")
    (change,) = plan.changes.all()
    assert change.offer.gpu_type.name == "L4" and change.offer.gpus_per_node == 1
    assert "(tp 1, pp 3 over 3 nodes)" in change.reason
    assert change.usd_h_delta == usd_h_for(change.offer, False, 1, 3) == Decimal("2.40")
    plans.approve(plan.pk, "tester")
    plans.start_apply(plan.pk, "tester")
    spec = spec_for(Replica.objects.select_related(
        "deployment__model", "region__cloud", "offer__gpu_type").get(deployment=d))
    assert (spec.gpus_per_node, spec.nodes, spec.tensor_parallel, spec.pipeline_parallel) == (
        1, 3, 1, 3)

