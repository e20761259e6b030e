"""The running lab, once Django is set up: it readies the database and keys, starts every
process (controlplane/lab/startup.py), watches them until Ctrl-C or SIGTERM (restarting a
dead control-plane process when there are several of each), and stops them all."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from controlplane.celery import app as celery_app
from controlplane.core.redis_clients import redis_client
from controlplane.lab.cli import LabStopped
from controlplane.lab.fleet import stop_local_replicas
from controlplane.lab.guard import release_guard, start_guard
from controlplane.lab.keys import prepare_keys
from controlplane.lab.processes import Child, ProcessGroup, say
from controlplane.lab.seed import prepare
from controlplane.lab.startup import start

CONTROL_PLANE = ("web", "worker", "provisioner", "batcher", "beat")


def run_lab(args: argparse.Namespace) -> int:
    """Run the lab until it is stopped or one of its processes dies; the exit status."""
    say("migrating, seeding the catalog and schedules, collecting static files")
    creds = prepare(args.var_dir)
    key_file = prepare_keys(args.var_dir)
    group = ProcessGroup(log_dir=args.var_dir / "lab" / "logs", env=dict(os.environ))
    guard = None
    code = 1
    try:
        if not args.no_fleet:
            # Engines are detached from the worker that starts them; the guard stops them if
            # the lab dies without its cleanup (SIGKILL).
            guard = start_guard(sys.executable, args.var_dir / "lab" / "replicas",
                                group.log_dir / "guard.log")
        forget_queued_tasks()
        start(args, group, creds, key_file)
        code = _watch(group, args.replicas_of_each)
    except (KeyboardInterrupt, LabStopped):
        code = 130
    finally:
        # Nothing may interrupt the cleanup, and a failing print must not skip it (say()
        # swallows a closed output).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say("stopping every process")
        group.stop()
        if not args.no_fleet:
            stopped = stop_local_replicas()
            say(f"terminated {len(stopped)} local replica(s)")
        if guard is not None:
            release_guard(guard)
        say("stopped")
    return code


def forget_queued_tasks() -> None:
    """Drop the Celery messages an earlier lab left in this lab's Redis database: a task
    queued for that lab's replica 2 (a terminate, say) would otherwise act on this lab's
    replica 2. A lab starts its fleet afresh from the database, so nothing queued is owed."""
    client = redis_client()
    names = [queue.name for queue in celery_app.conf.task_queues]
    stale = [*names, "unacked", "unacked_index", "unacked_mutex"]
    for name in names:  # a queue's priority lists: `<name>\x06\x16<priority>`
        stale += [key.decode() for key in client.scan_iter(match=f"{name}\x06\x16*")]
    client.delete(*stale)


def _watch(group: ProcessGroup, replicas_of_each: int) -> int:
    """Wait for a signal (0) or a process that dies and is not started again (1)."""
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    # Started: from here a signal only ends the wait below.
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    while not stopping:
        dead = group.dead()
        if dead and replicas_of_each > 1:
            dead = _restart_control_plane(group, dead)
        if dead:
            for child in dead:
                say(f"{child.name} exited with {child.process.returncode}; see {child.log_path}")
            return 1
        time.sleep(0.5)
    return 0


def _restart_control_plane(group: ProcessGroup, dead: list[Child]) -> list[Child]:
    """Start again each dead control-plane process (its peers served meanwhile); returns the
    dead children that are not the control plane's (an edge, Prometheus)."""
    others = []
    for child in dead:
        if child.name.rstrip("0123456789") not in CONTROL_PLANE:
            others.append(child)
            continue
        say(f"{child.name} exited with {child.process.returncode}; starting it again")
        group.children.remove(child)
        group.start(child.name, child.argv)
    return others
