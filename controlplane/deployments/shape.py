"""How many nodes one replica of a deployment is launched on: the one node-count rule. Pure.

Every replica runs one vLLM engine of the deployment's tensor_parallel × pipeline_parallel
ranks on nodes of its offer. A tensor-parallel group all-reduces every layer, so it stays
inside one node; pipeline stages split evenly over the nodes. Placement sizes and prices
offers by this rule (`placement.capacity.replica_shape`), provisioning launches exactly this
many nodes (`provisioning.services.spec_for`) and costs bill them (`costs.services`). Those
three are sibling capabilities, so the rule sits here, in the deployments layer below them
all, rather than in one of them for the others to import.
"""

from __future__ import annotations


def replica_nodes(tensor_parallel: int, pipeline_parallel: int, gpus_per_node: int
                  ) -> int | None:
    """Nodes of `gpus_per_node` GPUs that one engine of tp × pp ranks is launched on,
    ⌈tp × pp ÷ GPUs per node⌉, or None when such nodes cannot hold it: a TP group would cross
    a node, or the pipeline stages do not split evenly over the nodes."""
    if min(tensor_parallel, pipeline_parallel, gpus_per_node) < 1:
        return None
    if tensor_parallel > gpus_per_node:
        return None
    nodes = -(-tensor_parallel * pipeline_parallel // gpus_per_node)
    if pipeline_parallel % nodes:
        return None
    return nodes

