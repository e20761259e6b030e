"""The SkyPilot task of one replica: rendered from `infra/skypilot/replica.yaml.j2`
(`render_replica_task`) and validated by SkyPilot's own `Task.from_yaml_config`, which needs
no API server (`validate_replica_task`), before the provider (`skypilot.py`) launches it.
`sky` is imported only when a task is built.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import yaml

from controlplane.provisioning.base import ProviderError, ReplicaSpec
from controlplane.provisioning.engine_args import (
    kv_offload,
    kv_transfer_config,
    tls_args,
    vllm_serve_args,
)

TEMPLATE_PATH = Path(__file__).resolve().parents[2] / "infra" / "skypilot" / "replica.yaml.j2"
CLUSTER_PREFIX = "mrd-"
RAY_PORT = 6379
# Secrets the template declares without a value; filled in at launch from os.environ.
OPTIONAL_SECRETS = ("HF_TOKEN",)
# What the engine reads its key from, and the mTLS material's secrets (PEM text).
ENGINE_KEY_SECRET = "VLLM_API_KEY"
TLS_SECRETS = ("MERIDIAN_TLS_CERT", "MERIDIAN_TLS_KEY", "MERIDIAN_TLS_CA")
# Where the run script writes them, relative to the task's working directory.
REMOTE_TLS_DIR = ".meridian-tls"

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VERSION = re.compile(r"^[0-9]+(\.[0-9]+){1,3}([a-z0-9.+-]*)$")
_ACCELERATOR = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


# -- rendering and validation ---------------------------------------------------------------

def cluster_name_for(replica_id: str) -> str:
    """`mrd-<replica_id>`, lower-cased and limited to what every cloud accepts."""
    tail = re.sub(r"[^a-z0-9-]+", "-", replica_id.lower()).strip("-") or "replica"
    return (CLUSTER_PREFIX + tail)[:40].rstrip("-")


@lru_cache(maxsize=1)
def _template() -> jinja2.Template:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_PATH.parent)),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
        keep_trailing_newline=True, autoescape=False,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env.get_template(TEMPLATE_PATH.name)


def check_spec(spec: ReplicaSpec) -> None:
    """Refuse specs no SkyPilot task or vLLM server could honour, naming the field."""
    problems = []
    if not spec.cloud or not re.fullmatch(r"[a-z0-9-]+", spec.cloud):
        problems.append(f"cloud {spec.cloud!r} is not a SkyPilot cloud name")
    if not spec.region or not re.fullmatch(r"[A-Za-z0-9_.-]+", spec.region):
        problems.append(f"region {spec.region!r} is not a region code")
    if not _ACCELERATOR.fullmatch(spec.accelerator or ""):
        problems.append(f"accelerator {spec.accelerator!r} is not an accelerator name")
    for field in ("gpus_per_node", "nodes", "tensor_parallel", "pipeline_parallel",
                  "max_model_len", "disk_gb"):
        if int(getattr(spec, field)) < 1:
            problems.append(f"{field} must be at least 1, got {getattr(spec, field)}")
    if not 1 <= spec.port <= 65535 or spec.port == RAY_PORT:
        problems.append(f"port {spec.port} is not usable for the engine")
    if not _ENV_NAME.fullmatch(spec.api_key_env or ""):
        problems.append(f"api_key_env {spec.api_key_env!r} is not an environment variable name")
    if not _VERSION.fullmatch(spec.vllm_version or ""):
        problems.append(f"vllm_version {spec.vllm_version!r} is not a pinned version")
    for key in spec.env:
        if not _ENV_NAME.fullmatch(key) or key in (spec.api_key_env, ENGINE_KEY_SECRET,
                                                   *TLS_SECRETS, *OPTIONAL_SECRETS):
            problems.append(f"env {key!r} is not allowed (bad name, or a secret)")
    if not problems:
        world = spec.tensor_parallel * spec.pipeline_parallel
        gpus = spec.gpus_per_node * spec.nodes
        if world > gpus:
            problems.append(
                f"tensor_parallel {spec.tensor_parallel} × pipeline_parallel "
                f"{spec.pipeline_parallel} = {world} GPUs, but {spec.nodes} node(s) × "
                f"{spec.accelerator}:{spec.gpus_per_node} has {gpus}")
        if spec.nodes > 1 and spec.pipeline_parallel % spec.nodes:
            problems.append(f"pipeline_parallel {spec.pipeline_parallel} does not split evenly "
                            f"over {spec.nodes} nodes")
    if spec.engine != "vllm":
        problems.append(f"engine {spec.engine!r} runs only in local regions; a SkyPilot "
                        "replica runs vLLM")
    if spec.disaggregation and spec.kv_offload:
        problems.append("disaggregation and kv_offload each set vLLM's KV connector; "
                        "use one of them")
    if problems:
        raise ProviderError("invalid", "; ".join(problems))


def render_replica_task(spec: ReplicaSpec) -> str:
    """The SkyPilot task YAML for one replica (pure: reads only the template)."""
    check_spec(spec)
    _, extra_pips = kv_transfer_config(spec)
    offload = kv_offload(spec)
    pips = [f"vllm=={spec.vllm_version}"]
    if spec.nodes > 1:
        pips.append("ray[default]")
    if offload and offload["backend"] == "lmcache":
        pips.append("lmcache")
    pips.extend(extra_pips)
    return _template().render(
        replica_id=spec.replica_id, deployment=spec.deployment,
        cluster_name=cluster_name_for(spec.replica_id), cloud=spec.cloud, region=spec.region,
        accelerator=spec.accelerator, gpus_per_node=spec.gpus_per_node, nodes=spec.nodes,
        use_spot=spec.use_spot, disk_gb=spec.disk_gb, port=spec.port,
        vllm_version=spec.vllm_version, env=sorted(spec.env.items()),
        pip_packages=pips, ray_port=RAY_PORT, model=spec.model,
        tls=bool(spec.tls_dir), tls_dir=REMOTE_TLS_DIR,
        vllm_args=[*vllm_serve_args(spec, "0.0.0.0", spec.port),
                   *(tls_args(REMOTE_TLS_DIR) if spec.tls_dir else [])],
    )


def _load_yaml(yaml_text: str) -> dict[str, Any]:
    try:
        config = yaml.safe_load(yaml_text)
    except yaml.YAMLError as exc:
        raise ProviderError("invalid", f"task is not valid YAML: {exc}") from exc
    if not isinstance(config, dict):
        raise ProviderError("invalid", "task YAML is not a mapping")
    return config


def task_from_yaml(yaml_text: str, sdk: Any = None,
                   secrets: Iterable[tuple[str, str]] | None = None) -> Any:
    """A `sky.Task` from YAML text; any SkyPilot complaint becomes ProviderError('invalid')."""
    config = _load_yaml(yaml_text)
    if sdk is None:
        import sky as sdk  # noqa: PLC0415 - heavy, and only needed here
    try:
        return sdk.Task.from_yaml_config(config, secrets_overrides=list(secrets or []) or None)
    except Exception as exc:  # SkyPilot raises ValueError and its own schema errors
        raise ProviderError("invalid", f"SkyPilot rejects the task: {first_line(exc)}") from exc


def validate_replica_task(yaml_text: str) -> None:
    """Parse the YAML and build a `sky.Task` from it; raise ProviderError('invalid') if either
    fails, or if the task lost what a replica needs (cloud, region, accelerators, ports)."""
    task = task_from_yaml(yaml_text)
    resources = list(task.resources)
    if len(resources) != 1:
        raise ProviderError("invalid", f"a replica task has one resources entry, got "
                                       f"{len(resources)}")
    res = resources[0]
    missing = [name for name, value in (("cloud", res.cloud), ("region", res.region),
                                        ("accelerators", res.accelerators),
                                        ("ports", res.ports)) if not value]
    if missing:
        raise ProviderError("invalid", f"task resources lack {', '.join(missing)}")
    if not task.run or "vllm serve" not in str(task.run):
        raise ProviderError("invalid", "task run does not start `vllm serve`")
    _check_cloud_features(task, res)


# What a replica may ask of a cloud, in the words an operator would use.
_FEATURE_WORDS = {
    "spot_instance": "spot instances (use_spot)",
    "multi-node": "multi-node clusters (pipeline parallelism over nodes)",
    "open_ports": "opening the engine's port",
}


def _check_cloud_features(task: Any, res: Any) -> None:
    """Refuse what the cloud cannot do at all (Lambda has no spot, RunPod no multi-node), as
    SkyPilot's own per-cloud feature table says, before a launch finds out the slow way."""
    from sky.clouds import CloudImplementationFeatures as Feature  # noqa: PLC0415

    wanted = []
    if res.use_spot:
        wanted.append(Feature.SPOT_INSTANCE)
    if int(task.num_nodes or 1) > 1:
        wanted.append(Feature.MULTI_NODE)
    if res.ports:
        wanted.append(Feature.OPEN_PORTS)
    refused = []
    for feature in wanted:
        try:
            res.cloud.check_features_are_supported(res, {feature}, region=res.region)
        except Exception as exc:  # NotSupportedError, with SkyPilot's table of reasons
            if "NotSupportedError" not in class_names(exc):
                raise
            refused.append(_FEATURE_WORDS.get(feature.value, feature.value))
    if refused:
        accelerators = ",".join(f"{k}:{v}" for k, v in (res.accelerators or {}).items())
        raise ProviderError("invalid", f"{res.cloud} does not support {' or '.join(refused)} "
                                       f"(asked for {accelerators} × {task.num_nodes} node(s) "
                                       f"in {str(res.cloud).lower()}:{res.region})")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # SkyPilot colours some messages
    return text.splitlines()[0][:500]


def class_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}
