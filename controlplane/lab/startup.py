"""Starting the lab's processes: Prometheus, the control plane's processes, and (unless
--no-fleet) the demo fleet's engines and the edges, then the banner once the engines are
ready."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from controlplane.lab.banner import banner, print_banner
from controlplane.lab.engines import START_TIMEOUT_S as VLLM_READY_TIMEOUT_S
from controlplane.lab.fleet import (
    FLEETS,
    LabEdge,
    edge_argv,
    edge_certificate,
    ensure_fleet,
    lab_edges,
    stop_local_replicas,
    write_admin_secrets,
)
from controlplane.lab.layout import describe
from controlplane.lab.processes import ProcessGroup, say
from controlplane.lab.prometheus import start_prometheus
from controlplane.lab.readiness import UP, headline, wait_for_engines
from controlplane.lab.seed import LabCredentials

# Simulated engines answer within seconds of their launch; this bounds a busy machine's.
ENGINESIM_READY_TIMEOUT_S = 120.0


def start(args: argparse.Namespace, group: ProcessGroup, creds: LabCredentials,
          key_file: Path) -> None:
    """Start the control plane's processes, the fleet and the edges; print how to use them."""
    bind = f"{args.host}:{args.web_port}"
    _start_prometheus(args, group)
    start_control_plane(args, group, bind)
    base = f"http://{bind}"
    edges: list[LabEdge] = []
    up_line = UP
    if not args.no_fleet:
        edges = lab_edges(args.edge_port)
        up_line = _start_fleet(args, group, edges, key_file, base)
    print_banner(banner(up_line, base, creds, group.log_dir, edges, args.engine))


def _start_prometheus(args: argparse.Namespace, group: ProcessGroup) -> None:
    if os.environ.get("PROMETHEUS_URL"):
        say(f"  Prometheus: {os.environ['PROMETHEUS_URL']} (from the environment)")
    elif prometheus_url := start_prometheus(group, args.var_dir, args.host,
                                            args.prometheus_port, say):
        # The control plane started below reads telemetry from it (telemetry.metrics_source).
        os.environ["PROMETHEUS_URL"] = group.env["PROMETHEUS_URL"] = prometheus_url
        say(f"  Prometheus: {prometheus_url} (scraping the targets Meridian writes)")
    else:
        say("  Prometheus: not running; telemetry scrapes replicas and edges itself")


def start_control_plane(args: argparse.Namespace, group: ProcessGroup, bind: str) -> None:
    """The web tier, the three Celery workers and beat, `args.replicas_of_each` of each.

    With --replicas-of-each N: N gunicorn masters share the port (SO_REUSEPORT: the kernel
    spreads connections over the live ones), N workers per queue and N beats (each periodic
    task takes an advisory lock, so a task sent twice acts once).
    """
    python = sys.executable
    for i in range(1, args.replicas_of_each + 1):
        n = "" if i == 1 else str(i)
        # --preload: Django is imported once, in the master, before it binds and forks its
        # workers: a many-worker tier starts as fast as one worker, and a restarted master
        # never gets connections from the kernel while its workers are still importing.
        reuse = ["--reuse-port"] if args.replicas_of_each > 1 else []
        lane = [] if args.no_status_lane else [
            "--worker-class", "controlplane.lab.status_lane.StatusLaneWorker"]
        group.start(f"web{n}", [python, "-m", "gunicorn", "controlplane.wsgi", "--bind", bind,
                                "--workers", str(args.web_workers),
                                "--threads", str(args.web_threads), "--access-logfile", "-",
                                "--preload", *lane, *reuse])
        # Fast loops and slow provider jobs get their own workers, so a launch in progress
        # never delays the failover watch.
        group.start(f"worker{n}", [python, "-m", "celery", "-A", "controlplane", "worker",
                                   "-Q", "control", "--concurrency", "2", "-n", f"control{n}@%h",
                                   "--loglevel", "INFO"])
        group.start(f"provisioner{n}", [python, "-m", "celery", "-A", "controlplane", "worker",
                                        "-Q", "provision", "--concurrency", "2",
                                        "-n", f"provision{n}@%h", "--loglevel", "INFO"])
        # Batch runs hold a pool process for up to BATCH_TASK_BUDGET_S: a queue of their own
        # keeps them from delaying the control loops.
        group.start(f"batcher{n}", [python, "-m", "celery", "-A", "controlplane", "worker",
                                    "-Q", "batch", "--concurrency", "2", "-n", f"batch{n}@%h",
                                    "--loglevel", "INFO"])
        group.start(f"beat{n}", [python, "-m", "celery", "-A", "controlplane", "beat",
                                 "--loglevel", "INFO", "--schedule",
                                 str(args.var_dir / "lab" / f"celerybeat{n}-schedule")])


def _start_fleet(args: argparse.Namespace, group: ProcessGroup, edges: list[LabEdge],
                 key_file: Path, base: str) -> str:
    """The demo fleet's engines and the edges; returns the banner's headline once the engines
    are ready (or the wait for them ended)."""
    # A lab that was killed rather than stopped leaves engines behind: start clean (their
    # layout is kept, and brought back below).
    leftovers = stop_local_replicas(keep_empty=False)
    if leftovers:
        say(f"  terminated {len(leftovers)} replica(s) left by an earlier run")
    fleet = FLEETS[args.engine]
    started = ensure_fleet(edges, args.replicas_per_region, actor="lab", fleet=fleet)
    if started.restored:
        say(f"starting {len(edges)} edges and the {args.engine} replicas that were running: "
            f"{describe(started.restored)}")
    else:
        per_region = args.replicas_per_region if args.replicas_per_region is not None else 1
        say(f"starting {len(edges)} edges and {per_region} {args.engine} "
            f"replica(s) per region in {fleet.regions} regions")
    write_admin_secrets(edges, args.var_dir)
    token_file = args.var_dir / "lab" / "admin-token"
    for edge in edges:
        group.start(edge.name, edge_argv(sys.executable, edge, args.var_dir,
                                         key_file.with_suffix(".pub.pem"), base, token_file,
                                         tls=edge_certificate(edge, args.var_dir)))
    # "Up" only once every engine started above answers its readiness check; a process
    # of the lab's that dies meanwhile ends the wait (the caller reports it).
    timeout_s = args.ready_timeout if args.ready_timeout is not None else (
        VLLM_READY_TIMEOUT_S if args.engine == "vllm" else ENGINESIM_READY_TIMEOUT_S)
    waited_from = time.monotonic()
    engines = wait_for_engines([r.pk for r in started.requested], timeout_s, say,
                               give_up=lambda: bool(group.dead()))
    return headline(engines, time.monotonic() - waited_from)
