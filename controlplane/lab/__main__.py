"""`python -m controlplane.lab`: run the whole system on this machine until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from controlplane.lab import backing
from controlplane.lab.processes import ProcessGroup, quiet_broken_output, say

if TYPE_CHECKING:
    from controlplane.lab.bootstrap import LabCredentials


# The web tier on the 2-core lab machine: 2 workers × 4 threads served bench/api_load.py's 32
# clients best of those measured (2 × 4, 4 × 8 and 32 sync workers; README, Benchmarks): more
# processes or threads only share the same two cores more ways. Status polls get a lane of
# their own in each worker (controlplane/lab/status_lane.py).
WEB_WORKERS = 2
WEB_THREADS = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m controlplane.lab", description=__doc__)
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
    cleanup in `main`'s finally stops what was started so far."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_stopped)
    say("finding Postgres and Redis")
    database_url = os.environ.get("DATABASE_URL") or backing.lab_database_url()
    redis_url = os.environ.get("REDIS_URL") or backing.lab_redis_url()
    say(f"  Postgres: {_redact(database_url)}")
    say(f"  Redis:    {redis_url}")
    os.environ.update(DATABASE_URL=database_url, REDIS_URL=redis_url,
                      DJANGO_SETTINGS_MODULE="controlplane.settings",
                      MERIDIAN_VAR_DIR=str(args.var_dir.resolve()))
    os.environ.setdefault("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")
    # Lab mode (lab-only secrets, plain HTTP) for every process the lab starts.
    os.environ.setdefault("MERIDIAN_LAB", "1")
    # The lab launches local engines only, so plans, failover and autoscaling place there.
    os.environ.setdefault("MERIDIAN_PLACEMENT_CLOUDS", "local")
    # New deployments run what the lab runs unless they name an engine.
    os.environ["MERIDIAN_DEFAULT_ENGINE"] = args.engine
    if args.engine == "vllm" and not args.no_fleet:
        from controlplane.provisioning.local import cpu_engine_available, gpu_engine_available

        if not (gpu_engine_available() or cpu_engine_available()):
            say("no real engine here: run `make engine` (or `make up ENGINE=vllm`, which does)")
            return 2

    from controlplane.lab.bootstrap import ensure_database, prepare

    if ensure_database(database_url):
        say("  created the database")
    import django

    # The lab's data plane runs as production's does: mTLS between edges and engines, from
    # an engine CA of its own under var/keys (whatever the environment said).
    os.environ["MERIDIAN_ENGINE_TLS"] = "1"
    os.environ["MERIDIAN_CA_DIR"] = str(args.var_dir / "keys")
    django.setup()
    say("migrating, seeding the catalog and schedules, collecting static files")
    creds = prepare(args.var_dir)
    key_file = args.var_dir / "keys" / "signing-key.pem"
    os.environ["MERIDIAN_SIGNING_KEY_FILE"] = str(key_file)
    if not key_file.exists():
        from controlplane.routing.signing import generate_key_files

        generate_key_files(key_file)
        say(f"  generated the table-signing key {key_file}")
    # Each edge's admin secret derives from this key; made now, before any process needs it.
    os.environ["MERIDIAN_EDGE_ADMIN_KEY_FILE"] = str(args.var_dir / "keys" / "edge-admin.key")
    from controlplane.routing.edge_secrets import default_key_path, generate_key_file

    generate_key_file(default_key_path())
    from controlplane.core import certificates

    if not (certificates.ca_dir() / certificates.CA_KEY_FILE).exists():
        certificates.generate_ca_files(certificates.ca_dir())
        say(f"  generated the engine CA in {certificates.ca_dir()}")
    # Prometheus scrapes engines with a client certificate of its own (renewed in place).
    certificates.ensure_installed("scraper:prometheus", "client", "prometheus", [],
                                  args.var_dir / "prometheus" / "tls")

    group = ProcessGroup(log_dir=args.var_dir / "lab" / "logs", env=dict(os.environ))
    guard = None
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    code = 1
    try:
        if not args.no_fleet:
            from controlplane.lab.guard import start_guard

            # Engines are detached from the worker that starts them; the guard stops them if
            # the lab dies without its cleanup (SIGKILL).
            guard = start_guard(sys.executable, args.var_dir / "lab" / "replicas",
                                group.log_dir / "guard.log")
        _start(args, group, creds, key_file)
        # Started: from here a signal only ends the wait below.
        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)
        code = 0
        while not stopping:
            dead = group.dead()
            if dead and args.replicas_of_each > 1:
                dead = _restart_control_plane(group, dead)
            if dead:
                for child in dead:
                    say(f"{child.name} exited with {child.process.returncode}; "
                        f"see {child.log_path}")
                code = 1
                break
            time.sleep(0.5)
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
            from controlplane.lab.fleet import stop_local_replicas

            stopped = stop_local_replicas()
            say(f"terminated {len(stopped)} local replica(s)")
        if guard is not None:
            from controlplane.lab.guard import release_guard

            release_guard(guard)
        say("stopped")
    return code


def _start(args: argparse.Namespace, group: ProcessGroup, creds: LabCredentials,
           key_file: Path) -> None:
    """Start the control plane's processes, the fleet and the edges; print how to use them."""
    from controlplane.lab.prometheus import start_prometheus
    from controlplane.lab.readiness import UP, headline

    python = sys.executable
    bind = f"{args.host}:{args.web_port}"
    if os.environ.get("PROMETHEUS_URL"):
        say(f"  Prometheus: {os.environ['PROMETHEUS_URL']} (from the environment)")
    elif prometheus_url := start_prometheus(group, args.var_dir, args.host,
                                            args.prometheus_port, say):
        # The control plane started below reads telemetry from it (telemetry.metrics_source).
        os.environ["PROMETHEUS_URL"] = group.env["PROMETHEUS_URL"] = prometheus_url
        say(f"  Prometheus: {prometheus_url} (scraping the targets Meridian writes)")
    else:
        say("  Prometheus: not running; telemetry scrapes replicas and edges itself")
    # With --replicas-of-each N: N gunicorn masters share the port (SO_REUSEPORT: the kernel
    # spreads connections over the live ones), N workers per queue and N beats (each
    # periodic task takes an advisory lock, so a task sent twice acts once).
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

    base = f"http://{bind}"
    edges = []
    up_line = UP
    if not args.no_fleet:
        from controlplane.lab.fleet import (
            FLEETS,
            edge_argv,
            edge_certificate,
            ensure_fleet,
            lab_edges,
            stop_local_replicas,
            write_admin_secrets,
        )
        from controlplane.lab.layout import describe
        from controlplane.lab.readiness import wait_for_engines

        # A lab that was killed rather than stopped leaves engines behind: start clean (their
        # layout is kept, and brought back below).
        leftovers = stop_local_replicas(keep_empty=False)
        if leftovers:
            say(f"  terminated {len(leftovers)} replica(s) left by an earlier run")
        edges = lab_edges(args.edge_port)
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
            group.start(edge.name, edge_argv(python, edge, args.var_dir,
                                             key_file.with_suffix(".pub.pem"), base, token_file,
                                             tls=edge_certificate(edge, args.var_dir)))
        # "Up" only once every engine started above answers its readiness check; a process
        # of the lab's that dies meanwhile ends the wait (the caller reports it).
        timeout_s = args.ready_timeout if args.ready_timeout is not None else (
            _vllm_start_timeout_s() if args.engine == "vllm" else ENGINESIM_READY_TIMEOUT_S)
        waited_from = time.monotonic()
        engines = wait_for_engines([r.pk for r in started.requested], timeout_s, say,
                                   give_up=lambda: bool(group.dead()))
        up_line = headline(engines, time.monotonic() - waited_from)
    _print_banner(f"""
  {up_line}
    Dashboard   {base}/            (login: {creds.username} / {creds.password})
    Admin       {base}/admin/
    API docs    {base}/api/docs/
    API token   {creds.api_token}
    Demo key    {creds.demo_api_key}   (tenant 'demo', for the edges)
    Logs        {group.log_dir}/
    Edges       {" ".join(f"{e.name}={e.url}" for e in edges) or "(none: --no-fleet)"}

  Try:
    curl -s -H "Authorization: Bearer {creds.api_token}" {base}/api/v1/status/
    curl -s -H "Authorization: Bearer {creds.api_token}" "{base}/api/v1/offers/?gpu=H100&jurisdiction=EU&ordering=on_demand_usd_h"

{_edge_curl(edges, creds.demo_api_key, args.engine)}
  Ctrl-C stops everything.
""")


CONTROL_PLANE = ("web", "worker", "provisioner", "batcher", "beat")
# Simulated engines answer within seconds of their launch; this bounds a busy machine's.
ENGINESIM_READY_TIMEOUT_S = 120.0


def _vllm_start_timeout_s() -> float:
    from controlplane.lab.engines import START_TIMEOUT_S

    return START_TIMEOUT_S


def _restart_control_plane(group: ProcessGroup, dead: list) -> list:  # type: ignore[type-arg]
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


def _print_banner(text: str) -> None:
    try:
        print(text, flush=True)
    except (OSError, ValueError):
        quiet_broken_output()


def _raise_stopped(signum: int, frame: object) -> None:
    raise LabStopped


def _edge_curl(edges: list, key: str, engine: str) -> str:  # type: ignore[type-arg]
    if not edges:
        return ""
    from controlplane.lab.fleet import FLEETS

    model = FLEETS[engine].served_model_name
    body = (f'{{"model": "{model}", "stream": true, '
            '"messages": [{"role": "user", "content": "Where are you served from?"}]}')
    return (f"    curl -N {edges[0].url}/v1/chat/completions -H 'Authorization: Bearer {key}' "
            f"-H 'Content-Type: application/json' -d '{body}'\n")


def _redact(url: str) -> str:
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    credentials, host = rest.rsplit("@", 1)
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}@{host}"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (KeyboardInterrupt, LabStopped):  # stopped before anything was started
        sys.exit(130)
