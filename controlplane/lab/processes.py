"""A supervisor for the lab's child processes: start, watch, and stop them all together."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO


def say(message: str, stream: TextIO | None = None) -> None:
    """Print a lab line; an output nobody reads any more (a closed pipe, a gone terminal) is
    not an error: the lab still has to stop what it started."""
    try:
        print(f"[lab] {message}", file=stream or sys.stdout, flush=True)
    except (OSError, ValueError):  # BrokenPipeError is an OSError; ValueError: closed stream
        quiet_broken_output()


def quiet_broken_output() -> None:
    """Send what would still be written to stdout and stderr to /dev/null once their reader is
    gone, so that neither a later print nor the interpreter's exit flush raises."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass
    os.close(devnull)


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes]


@dataclass
class ProcessGroup:
    """Children started in their own sessions so one signal stops each with its descendants."""

    log_dir: Path
    env: dict[str, str]
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed with it
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**self.env, **(extra_env or {})},
            start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM),
        )
        log.close()
        child = Child(name, argv, log_path, process)
        self.children.append(child)
        return child

    def dead(self) -> list[Child]:
        return [child for child in self.children if child.process.poll() is not None]

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child's process group, then SIGKILL what is left after the grace."""
        for child in reversed(self.children):
            _signal_group(child.process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                child.process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                _signal_group(child.process, signal.SIGKILL)
                child.process.wait(timeout=5)
        for child in self.children:  # stragglers a child left in its group
            _signal_group(child.process, signal.SIGKILL)


PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` that has Linux send `sig` to the child when the process that started it
    dies, however it dies (SIGKILL included), so that nothing outlives the lab or a test
    run. None elsewhere than Linux (there, only an orderly stop cleans up)."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def preexec() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), sig)

    return preexec


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
