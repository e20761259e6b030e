"""Timing profiles: how long an engine takes to prefill and to decode, per model and GPU.

The two built-in profiles are the figures published with llm-d's inference simulator.
More can be added with a JSON file (`--profile-file`), a list of objects with the fields
of Profile.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class Profile:
    name: str
    overhead_s: float  # fixed cost before the first token
    prefill_s_per_token: float  # per uncached prompt token
    itl_s: float  # inter-token latency of a lone request
    # Decode slows as the batch grows (memory-bound: more KV read per step). At the
    # default 0.002, a batch of 128 decodes about 25% slower than a lone request.
    itl_growth_per_seq: float = 0.002
    max_num_seqs: int = 256
    kv_cache_tokens: int = 262_144
    max_model_len: int = 131_072
    prefill_chunk_tokens: int = 2048  # chunked prefill budget per engine step

    def itl_at(self, batch: int) -> float:
        """Decode step time with `batch` sequences decoding together."""
        return self.itl_s * (1.0 + self.itl_growth_per_seq * max(batch - 1, 0))


BUILTIN = {
    "llama-8b-h100": Profile("llama-8b-h100", 0.030, 250e-6, 0.012),
    "llama-70b-8xh100": Profile("llama-70b-8xh100", 0.080, 500e-6, 0.025,
                                kv_cache_tokens=1_048_576),
    # No timing at all: for measuring the proxy in front of an engine, not the engine.
    "instant": Profile("instant", 0.0, 0.0, 0.0, itl_growth_per_seq=0.0),
}
DEFAULT = "llama-8b-h100"


def load_profiles(path: Path | None = None) -> dict[str, Profile]:
    profiles = dict(BUILTIN)
    if path is not None:
        known = {f.name for f in fields(Profile)}
        for i, entry in enumerate(json.loads(path.read_text())):
            unknown = set(entry) - known
            if unknown:
                raise ValueError(f"{path}[{i}]: unknown field(s) {sorted(unknown)}")
            profile = Profile(**entry)
            profiles[profile.name] = profile
    return profiles
