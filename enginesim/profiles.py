"""Timing profiles: how long one model on one GPU setup takes to prefill and to decode.

A profile is the whole timing model of an engine: a fixed per-request overhead before the
request reaches the scheduler, a cost per uncached prompt token, and a decode step whose
length grows with the number of sequences decoding together. It also carries the engine
limits `vllm serve` would use on that hardware (max_num_seqs, max_num_batched_tokens, KV
capacity, context length), so that one name selects a coherent stand-in.

The two built-in profiles use the figures published with llm-d's inference simulator
(docs/latency-profiles.md: 8B on one H100: 30 ms overhead, 250 µs per prompt token, 12 ms
inter-token; 70B on 8 H100s: 80 ms, 500 µs, 25 ms). More profiles come from a JSON file,
given with `--profile-file` or the ENGINESIM_PROFILE_FILE environment variable: a list of
objects with the fields of Profile (name and the three timings required).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

PROFILE_FILE_ENV = "ENGINESIM_PROFILE_FILE"


@dataclass(frozen=True)
class Profile:
    name: str
    overhead_s: float
    prefill_s_per_token: float
    itl_s: float
    # Decode is memory-bound: each extra sequence adds KV reads to every step. At 0.002 a
    # batch of 128 decodes about 25% slower than a lone request, 256 about 51%.
    itl_growth_per_seq: float = 0.002
    # vLLM's defaults on GPUs with 70 GiB or more (vllm/engine/arg_utils.py,
    # get_batch_defaults, OPENAI_API_SERVER): 1024 sequences, 8192 tokens per step.
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    # Llama-3.1-8B in bf16 keeps 128 KiB of KV per token; one H100 at 0.9 memory
    # utilisation leaves about 54 GiB for it once weights and activations are placed.
    kv_cache_tokens: int = 440_000
    max_model_len: int = 131_072
    # The prefix cache's block: vLLM's 16 tokens on a GPU; its CPU build uses 128.
    block_tokens: int = 16

    def __post_init__(self) -> None:
        for name in ("overhead_s", "prefill_s_per_token", "itl_s", "itl_growth_per_seq"):
            if getattr(self, name) < 0:
                raise ValueError(f"profile {self.name!r}: {name} must be >= 0")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_tokens",
                     "max_model_len", "block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"profile {self.name!r}: {name} must be >= 1")

    def decode_step_s(self, batch: int) -> float:
        """Length of one decode step with `batch` sequences decoding together."""
        if batch <= 0:
            return 0.0
        return self.itl_s * (1.0 + self.itl_growth_per_seq * (batch - 1))

    def itl_at(self, batch: int) -> float:
        """Inter-token latency a stream sees in a pure decode batch of `batch` sequences."""
        return self.decode_step_s(max(batch, 1))


BUILTIN: dict[str, Profile] = {
    "llama-8b-h100": Profile("llama-8b-h100", 0.030, 250e-6, 0.012),
    # Llama-3.1-70B keeps 320 KiB of KV per token; eight H100s at 0.9 leave ~420 GiB.
    "llama-70b-8xh100": Profile("llama-70b-8xh100", 0.080, 500e-6, 0.025,
                                kv_cache_tokens=1_400_000),
    # SmolLM2-135M-Instruct on vLLM 0.32's CPU build, one core each (VLLM_CPU_OMP_THREADS_BIND),
    # as the benchmarks meet it on the shared 2-core development machine while other work
    # runs (bench/prefix_routing.py --engine vllm records it as engine_timing: 0.9-2.3 ms per
    # uncached prompt token, ~100 ms a lone decode step): ~80 ms before the first step,
    # 1.4 ms per uncached prompt token, an 80 ms decode step alone growing ~2.5% per extra
    # sequence. At a load average near 5 the same engine measured 0.7 ms and 40 ms; on an
    # idle core a decode step is ~15 ms. vLLM's CPU defaults: 128 sequences, 2,048 batched
    # tokens, 128-token blocks; VLLM_CPU_KVCACHE_SPACE=1 GiB at 23,040 bytes of KV per token
    # (30 layers × 3 KV heads × 64 × K and V × bf16) holds 364 blocks.
    "smollm2-135m-cpu": Profile("smollm2-135m-cpu", 0.080, 1.4e-3, 0.080,
                                itl_growth_per_seq=0.025, max_num_seqs=128,
                                max_num_batched_tokens=2048, kv_cache_tokens=364 * 128,
                                max_model_len=8192, block_tokens=128),
    # No modelled time at all: for measuring what sits in front of an engine.
    "instant": Profile("instant", 0.0, 0.0, 0.0, itl_growth_per_seq=0.0),
}
DEFAULT = "llama-8b-h100"


def load_profiles(path: Path | None = None) -> dict[str, Profile]:
    """The built-in profiles plus those in `path` (or $ENGINESIM_PROFILE_FILE).

    A file's profile replaces a built-in one of the same name. Errors name the file, the
    entry and the field.
    """
    profiles = dict(BUILTIN)
    if path is None and os.environ.get(PROFILE_FILE_ENV):
        path = Path(os.environ[PROFILE_FILE_ENV])
    if path is None:
        return profiles
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read profiles: {exc}") from exc
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of profile objects")
    known = {f.name for f in fields(Profile)}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{path}[{i}]: expected an object")
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ValueError(f"{path}[{i}]: unknown field(s) {unknown}; known: {sorted(known)}")
        missing = sorted({"name", "overhead_s", "prefill_s_per_token", "itl_s"} - set(entry))
        if missing:
            raise ValueError(f"{path}[{i}]: missing field(s) {missing}")
        try:
            profile = Profile(**entry)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}[{i}]: {exc}") from exc
        profiles[profile.name] = profile
    return profiles
