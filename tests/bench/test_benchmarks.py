"""Every benchmark runs: each bench/*.py at `--smoke`, found by glob (a new one is covered
without a change here), as a subprocess in a session of its own, killed on timeout.

Each run must end with one JSON line holding every key its benchmark declares in
`RESULT_KEYS`, and leave nothing running: every process a run starts inherits a marker
variable in its environment, and none may carry it once the run has exited. The benchmarks
that drive a lab (`SMOKE_LAB`) share one, started here with what each declares it needs, so
that the lab's start (most of a lab benchmark's time) is paid once; `--engine vllm` runs
(`SMOKE_ENGINES`) need the engine `make engine` builds.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.lab import child_lab
from controlplane.lab.engines import free_port
from controlplane.lab.waiting import WaitTimeout, wait_until
from tests.real_engine import require_engine

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BENCHES = sorted((REPO / "bench").glob("*.py"))
MARKER = "MERIDIAN_BENCH_SMOKE_RUN"
# Backstops for a run that hangs, not the expected durations (seconds on a quiet machine).
SMOKE_TIMEOUT_S = {"enginesim": 240.0, "vllm": 600.0}
# What the test run sets for itself (controlplane.lab.pytest_plugin) and a benchmark must
# not inherit.
TEST_ONLY_ENV = ("MERIDIAN_ENGINE_TLS",)
# Engines and relays a run stopped may take a moment to go once it has exited.
LEFTOVER_GRACE_S = 15.0


def declared(bench: Path) -> dict[str, Any]:
    """The module-level constants a benchmark declares for its smoke run (RESULT_KEYS,
    SMOKE_ENGINES, SMOKE_LAB), read from its source without importing it."""
    found: dict[str, Any] = {}
    for node in ast.parse(bench.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in (
                "RESULT_KEYS", "SMOKE_ENGINES", "SMOKE_LAB"):
            found[target.id] = ast.literal_eval(value)
    return found


def smoke_runs() -> list[Any]:
    """(benchmark, engine) for every benchmark and engine it declares: those on their own
    first, then those on a real engine, then those that share the lab (kept together, so
    that the lab runs only while they do)."""
    runs = []
    for bench in BENCHES:
        declaration = declared(bench)
        for engine in declaration.get("SMOKE_ENGINES", ("enginesim",)):
            order = 2 if "SMOKE_LAB" in declaration and engine == "enginesim" else int(
                engine == "vllm")
            runs.append((order, pytest.param(bench, engine, id=f"{bench.stem}-{engine}")))
    return [param for _, param in sorted(runs, key=lambda run: run[0])]


def marked_processes(token: str) -> dict[int, str]:
    """pid → command line of every process whose environment carries MARKER=token."""
    needle = f"{MARKER}={token}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(
                    b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def left_running(token: str, what: str) -> str | None:
    """None once no process marked with `token` runs (waiting out a grace); otherwise kills
    those left and says which they were."""
    try:
        wait_until(lambda: not marked_processes(token), LEFTOVER_GRACE_S,
                   f"every process {what} started to exit", every_s=0.2)
        return None
    except WaitTimeout:
        left = marked_processes(token)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return (f"{what} left {len(left)} process(es) running: "
                + "; ".join(f"{pid}: {argv[:160]}" for pid, argv in left.items()))


def assert_nothing_left(token: str, what: str) -> None:
    """Fails, after killing them, if processes marked with `token` outlive their grace."""
    left = left_running(token, what)
    if left is not None:
        pytest.fail(left)


def run_smoke(bench: Path, *args: str, timeout_s: float) -> tuple[str, str, float, str]:
    """(stdout, stderr, seconds, marker token) of `bench --smoke *args`; fails on a non-zero
    exit or a timeout (the run's whole session killed)."""
    token = uuid.uuid4().hex
    # As `make bench` runs them: lab mode, and none of the test run's own switches (the
    # pytest plugin's MERIDIAN_ENGINE_TLS=0 would hide a benchmark that breaks with mTLS).
    env = {key: value for key, value in os.environ.items() if key not in TEST_ONLY_ENV}
    env.update({MARKER: token, "MERIDIAN_LAB": "1"})
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(bench), "--smoke", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{bench.name} --smoke ran past {timeout_s:.0f} s; it printed:\n"
                    f"{err[-3000:]}")
    finally:  # however the wait ended (pytest-timeout's too), the run's session goes with it
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - started
    assert proc.returncode == 0, (f"{bench.name} --smoke exited with {proc.returncode}:\n"
                                  f"{err[-3000:]}")
    return out, err, seconds, token


@pytest.fixture(scope="module")
def shared_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One lab for every benchmark that declares SMOKE_LAB, started with the environment and
    arguments they declare; the file that describes it (their --lab)."""
    env: dict[str, str] = {}
    args: list[str] = []
    for bench in BENCHES:
        needs = declared(bench).get("SMOKE_LAB")
        if needs is None:
            continue
        env.update(needs.get("env", {}))
        args += list(needs.get("args", []))
    token = uuid.uuid4().hex
    var_dir = tmp_path_factory.mktemp("smoke-lab")
    lab = child_lab.start_lab(var_dir, replicas_per_region=1, name_prefix="meridian_smoke",
                              env={**env, MARKER: token},
                              extra=["--prometheus-port", str(free_port()), *args])
    description = var_dir / "lab.json"
    try:
        child_lab.describe_lab(lab, description)
        yield description
    finally:
        child_lab.stop_lab(lab)
    # What the lab itself leaves is the lab's to fix, not the benchmarks' (each of which is
    # held to nothing left above): a relay whose launch was cut short by control_plane_ha's
    # SIGKILL of a provision worker has been seen to outlive the lab. It is killed here and
    # reported, so that it neither lingers nor goes unseen.
    left = left_running(token, "the shared lab")
    if left is not None:
        warnings.warn(left, stacklevel=1)


# Above the backstops: the first lab benchmark's time includes the shared lab's start.
@pytest.mark.timeout(max(SMOKE_TIMEOUT_S.values()) + 300)
@pytest.mark.parametrize(("bench", "engine"), smoke_runs())
def test_benchmark_smoke_run_ends_with_its_json_and_leaves_nothing_running(
        bench: Path, engine: str, request: pytest.FixtureRequest) -> None:
    declaration = declared(bench)
    keys = declaration.get("RESULT_KEYS")
    assert keys, f"{bench.name} declares no RESULT_KEYS (the keys of its JSON line)"
    args = ["--engine", engine] if "SMOKE_ENGINES" in declaration else []
    if engine == "vllm":
        require_engine()
    elif "SMOKE_LAB" in declaration:
        args += ["--lab", str(request.getfixturevalue("shared_lab"))]
    out, err, seconds, token = run_smoke(bench, *args, timeout_s=SMOKE_TIMEOUT_S[engine])
    lines = out.strip().splitlines()
    assert lines, f"{bench.name} --smoke printed nothing on stdout:\n{err[-3000:]}"
    result = json.loads(lines[-1])
    missing = [key for key in keys if key not in result]
    assert not missing, f"{bench.name}'s JSON line lacks {missing}: {lines[-1][:500]}"
    assert_nothing_left(token, f"{bench.name} --smoke")
    print(f"{bench.stem} --smoke ({engine}): {seconds:.1f} s")


def test_a_process_left_running_is_found_by_its_marker() -> None:
    token = uuid.uuid4().hex
    sleeper = subprocess.Popen(["sleep", "60"], env={**os.environ, MARKER: token})
    try:
        assert list(marked_processes(token)) == [sleeper.pid]
        assert not marked_processes(uuid.uuid4().hex)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert marked_processes(token) == {}


def test_every_benchmark_declares_the_keys_of_its_json_line() -> None:
    undeclared = [bench.name for bench in BENCHES if not declared(bench).get("RESULT_KEYS")]
    assert BENCHES and not undeclared
