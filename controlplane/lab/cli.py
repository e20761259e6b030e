"""The lab's command line (`python -m controlplane.lab --help`) and the signal that stops it
while it starts; nothing here needs Django."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from controlplane.lab import backing

# The web tier on the 2-core lab machine: 2 workers × 4 threads served bench/api_load.py's 32
# clients best of those measured (2 × 4, 4 × 8 and 32 sync workers; README, Benchmarks): more
# processes or threads only share the same two cores more ways. Status polls get a lane of
# their own in each worker (controlplane/lab/status_lane.py).
WEB_WORKERS = 2
WEB_THREADS = 4

DESCRIPTION = "`python -m controlplane.lab`: run the whole system on this machine until Ctrl-C."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m controlplane.lab", description=DESCRIPTION)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--web-port", type=int, default=int(os.environ.get("MERIDIAN_WEB_PORT", 8000)))
    parser.add_argument("--var-dir", type=Path, default=backing.VAR_DIR)
    parser.add_argument("--edge-port", type=int, default=8100,
                        help="first edge's client port; admin ports start 10 higher")
    parser.add_argument("--replicas-per-region", type=int, default=None, metavar="N",
                        help="the demo deployment's replicas in each region (default: the "
                             "layout the last run stopped, else 1)")
    parser.add_argument("--ready-timeout", type=float, default=None, metavar="S",
                        help="how long to wait for the engines before saying which are still "
                             "starting (default 120 s for enginesim, "
                             "$MERIDIAN_VLLM_START_TIMEOUT_S or 240 s for vllm)")
    parser.add_argument("--prometheus-port", type=int, default=9090,
                        help="where the lab's Prometheus listens, when it is installed")
    parser.add_argument("--engine", choices=("enginesim", "vllm"),
                        default=os.environ.get("MERIDIAN_LAB_ENGINE", "enginesim"),
                        help="what serves the demo deployment: enginesim (simulated, three "
                             "regions) or vllm (real vLLM CPU engines from `make engine`, "
                             "two regions, one core each)")
    parser.add_argument("--no-fleet", action="store_true",
                        help="control plane only: no local replicas, no edges")
    parser.add_argument("--web-workers", type=int, default=WEB_WORKERS,
                        help="gunicorn worker processes (default %(default)s)")
    parser.add_argument("--web-threads", type=int, default=WEB_THREADS,
                        help="threads per gunicorn worker (default %(default)s; 1: sync workers)")
    parser.add_argument("--no-status-lane", action="store_true",
                        help="plain gthread workers: status polls queue behind other requests "
                             "(controlplane/lab/status_lane.py)")
    parser.add_argument("--replicas-of-each", type=int, default=1, metavar="N",
                        help="run N of each control-plane process (web, control worker, "
                             "provision worker, batch worker, beat); with 2 or more the lab "
                             "restarts one that dies, as a process manager would, instead of stopping")
    return parser.parse_args(argv)


class LabStopped(BaseException):
    """SIGTERM while the lab starts: unwinds like Ctrl-C's KeyboardInterrupt, so that the
    cleanup in `supervisor.run_lab`'s finally stops what was started so far."""


def raise_stopped(signum: int, frame: object) -> None:
    """SIGTERM's handler until the lab is up."""
    raise LabStopped
