"""What a plan sizes and prices is what provisioning launches: the deployment's TP × PP, on
the nodes the plan chose, at the $/h the plan counted."""

from __future__ import annotations

from decimal import Decimal

import pytest
import yaml

from controlplane.costs.services import replica_usd_h_sql, usd_h_for
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.placement.capacity import GpuSpec, replica_nodes, replica_shape
from controlplane.placement.models import ChangeAction, PlanStatus
from controlplane.placement.proposals import model_spec, propose_plan
from controlplane.plans import apply as plans
from controlplane.provisioning.base import ProviderError
from controlplane.provisioning.local import LocalProvider
from controlplane.provisioning.services import launch, spec_for
from controlplane.provisioning.skypilot_task import render_replica_task
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
    assert change.offer is not None
    assert change.offer.gpu_type.name == "L4" and change.offer.gpus_per_node == 1
    assert "(tp 1, pp 3 over 3 nodes)" in change.reason
    assert change.usd_h_delta == usd_h_for(change.offer, False, 1, 3) == Decimal("2.40")
    plans.approve(plan.pk, "tester")
    plans.start_apply(plan.pk, "tester")
    spec = spec_for(Replica.objects.select_related(
        "deployment__model", "region__cloud", "offer__gpu_type").get(deployment=d))
    assert (spec.gpus_per_node, spec.nodes, spec.tensor_parallel, spec.pipeline_parallel) == (
        1, 3, 1, 3)



@pytest.mark.parametrize(("pp", "nodes"), [
    (4, 2),  # 16 ranks: two 8-GPU nodes, two stages on each
    (3, None),  # 12 ranks: two nodes, but three stages do not split over two
])
def test_one_node_count_places_launches_and_bills_a_layout(catalog, tenants, sent_tasks,  # type: ignore[no-untyped-def]
                                                            pp, nodes):
    """TP 4 on 8×H100 nodes: the solver, provisioning and costs count nodes by one rule, so
    a layout is placed, launched and billed on the same nodes, or refused by all three."""
    d = make_deployment({**catalog, **tenants}, "chat-eu")
    d.min_replicas, d.max_replicas = 1, 1
    d.tensor_parallel, d.pipeline_parallel = 4, pp
    d.save()
    h100x8 = Offer.objects.create(region=catalog["fra"], gpu_type=catalog["h100"],
                                  gpus_per_node=8, instance_type="p5.48xlarge",
                                  on_demand_usd_h=Decimal("98.32"),
                                  observed_at=catalog["fra"].offers.first().observed_at)
    assert replica_nodes(4, pp, 8) == nodes
    plan = propose_plan([d], actor="tester", trigger="test")
    if nodes is None:
        # Placement: no option; provisioning: refused by name; costs: no $/h.
        assert plan.status == PlanStatus.INFEASIBLE
        assert "8× H100 nodes cannot hold chat-eu's engine (tp 4 × pp 3" in plan.explanation
        replica = Replica.objects.create(deployment=d, region=catalog["fra"], offer=h100x8)
        with pytest.raises(ProviderError, match="8× H100 nodes cannot hold chat-eu's engine"):
            spec_for(replica)
        launch(replica.pk)
        replica.refresh_from_db()
        assert replica.state == S.FAILED and "cannot hold" in replica.last_error
        assert usd_h_for(h100x8, False, 4, pp) == 0
        assert Replica.objects.annotate(usd_h=replica_usd_h_sql()).get().usd_h is None
        return
    (change,) = plan.changes.all()
    assert change.offer_id == h100x8.pk and f"over {nodes} nodes" in change.reason
    plans.approve(plan.pk, "tester")
    plans.start_apply(plan.pk, "tester")
    replica = Replica.objects.select_related(
        "deployment__model", "region__cloud", "offer__gpu_type").get(deployment=d)
    spec = spec_for(replica)
    assert (spec.gpus_per_node, spec.nodes, spec.tensor_parallel, spec.pipeline_parallel) == (
        8, nodes, 4, pp)
    task = yaml.safe_load(render_replica_task(spec))
    assert task["num_nodes"] == nodes and task["resources"]["accelerators"] == "H100:8"
    billed = Decimal("98.32") * nodes
    assert change.usd_h_delta == usd_h_for(h100x8, False, 4, pp) == billed
    assert Replica.objects.annotate(usd_h=replica_usd_h_sql()).get().usd_h == billed
