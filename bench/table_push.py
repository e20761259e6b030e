"""How long from a committed change until every edge has acked the new table.

For 10, 100 and 1,000 edges: a replica's state change is committed, tables are compiled,
signed and pushed to every edge in parallel, and each edge verifies the Ed25519 signature
before it answers. The edges here are lightweight admin endpoints (one aiohttp process
serving one port per edge, verifying every table); the control-plane side is the real code.
Reports per-edge ack latency percentiles from the commit.

    python bench/table_push.py [--quick | --smoke] [--edges 10,100,1000]

(`--quick` runs the same rounds as the full run; `--smoke`: 10 edges, one trial, to check
that every step runs, not the figures)

Prints progress on stderr and one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# What every run's JSON line holds (tests/bench/test_benchmarks.py checks it at --smoke).
RESULT_KEYS = ("benchmark", "quick", "smoke", "edges", "push_p50_s", "push_p99_s",
               "push_max_s", "unacked", "rounds", "targets")


def log(message: str) -> None:
    print(f"[table_push] {message}", file=sys.stderr, flush=True)


def serve_edges(count: int, public_pem: bytes, ports: mp.Queue[list[int]], stop: Event) -> None:
    """One process, `count` admin ports, each verifying and version-checking like an edge."""
    import asyncio

    from aiohttp import web

    from edge.keys import load_public_key
    from edge.table import verify_table

    key = load_public_key(public_pem)

    async def main() -> None:
        runners = []
        opened = []
        for _ in range(count):
            state = {"version": 0}

            async def put_table(request: web.Request, state=state) -> web.Response:  # type: ignore[no-untyped-def]
                table = json.loads(await request.read())
                verify_table(table, key)
                if table["version"] <= state["version"]:
                    return web.Response(status=409)
                state["version"] = table["version"]
                return web.json_response({"version": state["version"]})

            app = web.Application()
            app.router.add_put("/admin/table", put_table)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=256)
            await site.start()
            opened.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
            runners.append(runner)
        ports.put(opened)
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for runner in runners:
            await runner.cleanup()

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())


def setup_django(db_name: str) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("MERIDIAN_LAB", "1")  # a bench runs on the lab
    from controlplane.lab import backing

    base = os.environ.get("DATABASE_URL") or backing.lab_database_url()
    url = base.rsplit("/", 1)[0] + "/" + db_name if "?" not in base else base
    os.environ["DATABASE_URL"] = url
    from controlplane.lab.bootstrap import ensure_database

    ensure_database(url)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def run_round(n_edges: int, tmp: Path, trials: int = 3) -> dict[str, Any]:
    from django.db import transaction

    from controlplane.deployments.models import Deployment, Model, Replica
    from controlplane.deployments.models import ReplicaState as S
    from controlplane.routing import services, signing
    from controlplane.routing.models import Edge, RoutingTable
    from regions.models import Cloud, Jurisdiction, Region

    private, public = signing.generate_key_files(tmp / f"key-{n_edges}.pem", overwrite=True)
    os.environ["MERIDIAN_SIGNING_KEY_FILE"] = str(private)
    signing.signing_key.cache_clear()

    RoutingTable.objects.all().delete()
    Edge.objects.all().delete()
    Replica.objects.all().delete()
    eu, _ = Jurisdiction.objects.get_or_create(code="EU", defaults={"name": "EU"})
    cloud, _ = Cloud.objects.get_or_create(name="bench", defaults={"display_name": "bench"})
    region, _ = Region.objects.get_or_create(
        cloud=cloud, code="eu", defaults={"display_name": "eu", "latitude": 50.1,
                                          "longitude": 8.7, "country": "DE", "jurisdiction": eu})
    model, _ = Model.objects.get_or_create(
        name="bench-8b", defaults={"hf_id": "x/y", "parameters_b": 8, "layers": 32,
                                   "attention_heads": 32, "kv_heads": 8, "head_dim": 128,
                                   "max_context": 8192})
    deployment, _ = Deployment.objects.get_or_create(
        name="bench", defaults={"served_model_name": "bench-8b", "model": model})
    deployment.allowed_jurisdictions.set([eu])
    replicas = [Replica.objects.create(deployment=deployment, region=region, state=S.READY,
                                       url=f"http://127.0.0.1:{9000 + i}") for i in range(8)]

    ports_q: mp.Queue[list[int]] = mp.Queue()
    stop = mp.Event()
    # A daemon: never left running, even when its cleanup hangs (it is stopped below).
    server = mp.Process(target=serve_edges, args=(n_edges, public.read_bytes(), ports_q, stop),
                        daemon=True)
    server.start()
    ports = ports_q.get(timeout=120)
    Edge.objects.bulk_create([
        Edge(name=f"edge-{i}", region=region, admin_url=f"http://127.0.0.1:{port}")
        for i, port in enumerate(ports)
    ])
    services.publish()  # initial tables: every edge starts in sync
    samples: list[float] = []
    unacked: list[str] = []  # pushes an edge did not ack within the push's own limit
    try:
        for trial in range(trials):
            with transaction.atomic():
                Replica.objects.filter(pk=replicas[trial].pk).update(state=S.DEGRADED)
            committed = time.perf_counter()
            tables = services.compile_tables()
            compiled = time.perf_counter()
            results = services.push_tables(tables)
            unacked += [r.detail or "no ack" for r in results if not r.acked]
            samples.extend((compiled - committed) + r.seconds for r in results if r.acked)
            missing = sum(1 for r in results if not r.acked)
            log(f"{n_edges} edges, trial {trial + 1}: "
                f"{'all acked' if not missing else f'{missing} not acked, the rest'} in "
                f"{time.perf_counter() - committed:.3f} s (compile {compiled - committed:.3f} s)")
    finally:
        stop.set()
        server.join(30)
        if server.is_alive():
            server.terminate()
            server.join(10)
    samples.sort()
    return {
        "edges": n_edges,
        "push_p50_s": round(statistics.median(samples), 4) if samples else None,
        "push_p99_s": round(samples[min(len(samples) - 1, int(len(samples) * 0.99))], 4)
        if samples else None,
        "push_max_s": round(samples[-1], 4) if samples else None,
        # Not in the percentiles above, which are over acked pushes: any here is a miss.
        "unacked": len(unacked), "unacked_reasons": sorted(set(unacked))[:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the same rounds as the full run, which finishes in well under a "
                             "minute")
    parser.add_argument("--smoke", action="store_true",
                        help="10 edges, one trial: every step, not the figures")
    parser.add_argument("--edges", default=None, help="edge counts (default 10,100,1000)")
    args = parser.parse_args()
    counts = [int(n) for n in (args.edges or ("10" if args.smoke else "10,100,1000")).split(",")]
    setup_django("meridian_bench")
    import tempfile

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            log(f"starting {n} edge endpoints")
            rounds.append(run_round(n, Path(tmp), trials=1 if args.smoke else 3))
    largest = rounds[-1]
    result = {"benchmark": "table_push", "quick": args.quick, "smoke": args.smoke, **largest,
              "rounds": rounds,
              "targets": {"100_edges_s": 1.0, "1000_edges_s": 3.0}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
