"""`python -m controlplane.lab`: run the whole system on this machine until Ctrl-C.

This module readies what Django needs (the environment, the database) and sets Django up;
`controlplane/lab/supervisor.py` does the rest.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import django

from controlplane.lab import backing
from controlplane.lab.bootstrap import ensure_database
from controlplane.lab.cli import LabStopped, parse_args, raise_stopped
from controlplane.lab.processes import say
from controlplane.provisioning.local import cpu_engine_available, gpu_engine_available


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, raise_stopped)
    say("finding Postgres and Redis")
    database_url = os.environ.get("DATABASE_URL") or backing.lab_database_url()
    redis_url = os.environ.get("REDIS_URL") or backing.lab_redis_url()
    say(f"  Postgres: {_redact(database_url)}")
    say(f"  Redis:    {redis_url}")
    _set_environment(args, database_url, redis_url)
    if args.engine == "vllm" and not args.no_fleet:
        if not (gpu_engine_available() or cpu_engine_available()):
            say("no real engine here: run `make engine` (or `make up ENGINE=vllm`, which does)")
            return 2
    if ensure_database(database_url):
        say("  created the database")
    # The lab's data plane runs as production's does: mTLS between edges and engines, from
    # an engine CA of its own under var/keys (whatever the environment said).
    os.environ["MERIDIAN_ENGINE_TLS"] = "1"
    os.environ["MERIDIAN_CA_DIR"] = str(args.var_dir / "keys")
    django.setup()
    # The supervisor's modules import models, which Django allows only once set up.
    from controlplane.lab.supervisor import run_lab

    return run_lab(args)


def _set_environment(args: argparse.Namespace, database_url: str, redis_url: str) -> None:
    """What every process the lab starts reads from its environment."""
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
