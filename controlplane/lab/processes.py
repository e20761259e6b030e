"""A supervisor for the lab's child processes: start, watch, and stop them all together."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


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
            start_new_session=True,
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


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
