"""`manage.py render_skypilot_task`: print the SkyPilot task a deployment's replica would use.

Checks before it renders: the deployment, region and GPU exist, the region sells that GPU in
that count per node (and a spot price exists with --spot), the parallelism fits the nodes,
and the model's weights plus one max-length sequence fit the GPUs (placement.capacity).
"""

from __future__ import annotations

import math
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.deployments.models import Deployment
from controlplane.placement.capacity import (
    GIB,
    GpuSpec,
    ModelSpec,
    kv_bytes_per_token,
    max_concurrency,
    usable_bytes,
    valid_tensor_parallel,
    weight_bytes,
)
from controlplane.provisioning.base import ProviderError, ReplicaSpec
from controlplane.provisioning.skypilot_task import render_replica_task, validate_replica_task
from regions.models import GpuType, Offer, Region


def parse_gpu(text: str) -> tuple[str, int]:
    """`H100:8` → ("H100", 8); `H100` → ("H100", 1)."""
    name, _, count = text.partition(":")
    try:
        number = int(count) if count else 1
    except ValueError:
        raise CommandError(f"--gpu {text!r}: the count after ':' must be a whole number") from None
    if not name or number < 1:
        raise CommandError(f"--gpu {text!r}: expected NAME:COUNT such as H100:8")
    return name, number


def nodes_for(tensor_parallel: int, pipeline_parallel: int, gpus_per_node: int) -> int:
    """Nodes of `gpus_per_node` GPUs one replica needs; TP stays inside a node, PP spans."""
    if tensor_parallel > gpus_per_node:
        raise CommandError(f"tensor_parallel {tensor_parallel} needs {tensor_parallel} GPUs on "
                           f"one node, but the node has {gpus_per_node}")
    nodes = math.ceil(tensor_parallel * pipeline_parallel / gpus_per_node)
    if pipeline_parallel % nodes:
        raise CommandError(f"pipeline_parallel {pipeline_parallel} does not split evenly over "
                           f"the {nodes} nodes that tensor_parallel {tensor_parallel} × "
                           f"pipeline_parallel {pipeline_parallel} needs at {gpus_per_node} "
                           "GPUs per node")
    return nodes


class Command(BaseCommand):
    help = "Render (and validate) the SkyPilot task YAML for one replica of a deployment."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("deployment", help="deployment name")
        parser.add_argument("--region", required=True, help="CLOUD:REGION, e.g. aws:us-east-1")
        parser.add_argument("--gpu", required=True, help="GPU:COUNT per node, e.g. H100:8")
        parser.add_argument("--spot", action="store_true", help="use spot instances")
        parser.add_argument("--replica-id", default="r-0",
                            help="replica id for the cluster name (default r-0)")

    def handle(self, *args: Any, **options: Any) -> None:
        deployment = self._deployment(options["deployment"])
        region = self._region(options["region"])
        gpu_name, count = parse_gpu(options["gpu"])
        gpu = self._gpu(gpu_name)
        if not region.cloud.skypilot_name:
            raise CommandError(f"{region.key}: cloud {region.cloud.name} is not driven by "
                               "SkyPilot (it has no skypilot_name)")
        self._offer(region, gpu, count, options["spot"])
        tp, pp = deployment.tensor_parallel, deployment.pipeline_parallel
        nodes = nodes_for(tp, pp, count)
        self._check_fit(deployment, gpu, tp, pp)
        spec = ReplicaSpec(
            replica_id=options["replica_id"], deployment=deployment.name,
            model=deployment.model.hf_id, served_model_name=deployment.served_model_name,
            cloud=region.cloud.skypilot_name, region=region.code,
            accelerator=gpu.skypilot_name or gpu.name, gpus_per_node=count, nodes=nodes,
            use_spot=options["spot"], tensor_parallel=tp, pipeline_parallel=pp,
            max_model_len=deployment.max_model_len,
            enable_prefix_caching=deployment.enable_prefix_caching,
        )
        try:
            text = render_replica_task(spec)
            validate_replica_task(text)
        except ProviderError as exc:
            raise CommandError(f"cannot render the task: {exc.message}") from exc
        self.stdout.write(text, ending="")

    # -- lookups ----------------------------------------------------------------------------
    def _deployment(self, name: str) -> Deployment:
        found = Deployment.objects.select_related("model").filter(name=name).first()
        if found is None:
            known = ", ".join(Deployment.objects.values_list("name", flat=True)) or "none"
            raise CommandError(f"unknown deployment {name!r} (known: {known})")
        return found

    def _region(self, key: str) -> Region:
        region = (Region.objects.select_related("cloud").filter(**Region.key_filter(key))
                  .first() if ":" in key else None)
        if region is None:
            known = ", ".join(r.key for r in Region.objects.select_related("cloud")) or "none"
            raise CommandError(f"unknown region {key!r}; use CLOUD:REGION (known: {known})")
        return region

    def _gpu(self, name: str) -> GpuType:
        gpu = (GpuType.objects.filter(name=name).first()
               or GpuType.objects.filter(skypilot_name=name).first())
        if gpu is None:
            known = ", ".join(GpuType.objects.values_list("name", flat=True)) or "none"
            raise CommandError(f"unknown GPU {name!r} (known: {known})")
        return gpu

    def _offer(self, region: Region, gpu: GpuType, count: int, spot: bool) -> Offer:
        offers = list(Offer.objects.filter(region=region).select_related("gpu_type"))
        match = [o for o in offers if o.gpu_type_id == gpu.pk and o.gpus_per_node == count]
        if not match:
            shapes = ", ".join(sorted({f"{o.gpu_type.name}:{o.gpus_per_node}" for o in offers}))
            raise CommandError(f"{region.key} has no offer of {gpu.name}:{count} "
                               f"(offers there: {shapes or 'none'})")
        if spot:
            priced = [o for o in match if o.spot_usd_h is not None]
            if not priced:
                raise CommandError(f"{region.key} sells {gpu.name}:{count} on demand only "
                                   "(no spot price); drop --spot")
            match = priced
        return min(match, key=lambda o: o.on_demand_usd_h)

    def _check_fit(self, deployment: Deployment, gpu: GpuType, tp: int, pp: int) -> None:
        row = deployment.model
        model = ModelSpec(row.name, row.parameters_b, row.layers, row.attention_heads,
                          row.kv_heads, row.head_dim, row.dtype, row.active_parameters_b)
        if not valid_tensor_parallel(model, tp):
            raise CommandError(f"tensor_parallel {tp} does not divide {row.name}'s "
                               f"{row.attention_heads} attention heads / {row.kv_heads} KV heads")
        spec = GpuSpec(gpu.name, gpu.memory_gib, gpu.memory_bandwidth_gbps)
        gpus = tp * pp
        if max_concurrency(model, spec, gpus, deployment.max_model_len) < 1:
            need = (weight_bytes(model)
                    + kv_bytes_per_token(model) * deployment.max_model_len) / GIB
            have = usable_bytes(spec, gpus) / GIB
            raise CommandError(
                f"{row.name} does not fit on {gpus} × {gpu.name}: weights plus one "
                f"{deployment.max_model_len}-token sequence need {need:.1f} GiB, "
                f"{have:.1f} GiB usable; raise tensor_parallel/pipeline_parallel or use a "
                "larger GPU")
