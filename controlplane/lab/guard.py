"""The lab's guard: stops the lab's local engines and relays when the lab dies, however it dies.

Local replicas are detached on purpose (their own sessions, see provisioning/local.py) so that
they outlive a Celery worker restart; an orderly lab stop terminates them itself. A lab killed
with SIGKILL (a benchmark or test run killed, an out-of-memory kill) cannot, so the lab starts
this process with a pipe on its stdin that only the lab holds: end of file means the lab is
gone, and the guard kills every engine and relay recorded in the state directory.
`python -m controlplane.lab.guard STATE_DIR`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from controlplane.provisioning.local import LocalProvider
from controlplane.provisioning.local_processes import kill_group, runs

# A launch job that was running when the lab died may still write its record: look again.
SWEEPS = 3
SWEEP_GAP_S = 2.0
# What the lab writes once it has stopped its replicas itself: nothing is left to do.
STOPPED = b"stopped\n"


def stop_recorded(state_dir: Path, grace_s: float = 2.0) -> list[str]:
    """Kill the engine and relay process groups of every record under `state_dir` that still
    runs (a process is ours only if its command line and start time match the record)."""
    stopped = []
    for record in LocalProvider(state_dir, []).records():
        alive = False
        for prefix in ("relay_", ""):
            if runs(record, prefix):
                kill_group(int(record[f"{prefix}pid"]), grace_s)
                alive = True
        if alive:
            stopped.append(str(record.get("replica_id", "")))
    return stopped


def start_guard(python: str, state_dir: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """Start the guard; the lab keeps the returned process's stdin open until it has stopped
    its replicas itself, then writes STOPPED and closes it (see `release_guard`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [python, "-m", "controlplane.lab.guard", str(state_dir)], stdin=subprocess.PIPE,
            stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # not in the lab's process group: it must outlive the lab
        )


def release_guard(guard: subprocess.Popen[bytes]) -> None:
    """Tell the guard the lab stopped its replicas itself, and let it go."""
    assert guard.stdin is not None
    try:
        guard.stdin.write(STOPPED)
        guard.stdin.close()
        guard.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        pass


def main(argv: list[str]) -> int:
    state_dir = Path(argv[0])
    said = b""
    while chunk := os.read(0, 4096):  # EOF when the lab's end closes
        said += chunk
    if said.endswith(STOPPED):  # the lab stopped its replicas itself
        return 0
    for sweep in range(SWEEPS):
        stopped = stop_recorded(state_dir)
        if stopped:
            print(f"guard: stopped {', '.join(stopped)}", flush=True)
        if sweep + 1 < SWEEPS:
            time.sleep(SWEEP_GAP_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
