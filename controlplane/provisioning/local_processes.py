"""The local provider's processes: whether a pid is alive and still the process a record
describes (pids are reused), and stopping a process group with a grace period."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# How long an engine gets to drain on SIGTERM before its process group is killed.
STOP_GRACE_S = 5.0


def pid_alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not yet reaped) counts as dead."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = proc_stat(pid)
    if fields is None:
        return True
    if fields[0] == "Z":
        try:
            os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
        except ChildProcessError:
            pass
        return False
    return True


def process_cmdline(pid: int) -> list[str] | None:
    """The argv a live process was started with (None when it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part] or None


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields or None


def process_started(pid: int) -> int | None:
    """When the kernel started the process (clock ticks since boot), or None when it is gone.
    It stays the same across exec, unlike the command line (tools/vllm-cpu execs Python)."""
    fields = proc_stat(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def is_our_process(pid: int | None, cmdline: list[str] | None,
                   started: int | None = None) -> bool:
    """The pid is alive and is still the process we started (pids are reused after exit):
    by its start time where the record has one, else by its command line."""
    if not pid or not pid_alive(int(pid)):
        return False
    if started is not None:
        return process_started(int(pid)) == started
    if not cmdline:
        return True  # a record from before cmdlines were kept: the pid is all we have
    return process_cmdline(int(pid)) == list(cmdline)


def runs(record: Mapping[str, Any], prefix: str = "") -> bool:
    """The record's engine (prefix "") or relay (prefix "relay_") is alive and ours."""
    return is_our_process(record.get(f"{prefix}pid"), record.get(f"{prefix}cmdline"),
                          record.get(f"{prefix}pid_started"))


def kill_group(pid: int, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group, then SIGKILL it if it outlives the grace period."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            return  # not ours (the pid was reused by another user's process)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.05)
