"""The lab's fleet: local regions, a demo deployment with replicas in each, and edges.

Replicas are launched the way production launches them — pending rows that the Celery
worker provisions through the LocalProvider — so the lab exercises the real control path.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from django.db import close_old_connections, transaction

from controlplane.core import certificates
from controlplane.core.models import Tenant
from controlplane.deployments.lifecycle import LIVE_STATES, STAYING_STATES
from controlplane.deployments.models import Deployment, Model, Replica
from controlplane.lab.layout import Layout, last_layout, record_layout, running_layout
from controlplane.lab.regions import LAB_REGIONS, ensure_lab_regions
from controlplane.provisioning import services
from controlplane.provisioning.tasks import request_replicas
from controlplane.routing.edge_secrets import edge_secret
from controlplane.routing.models import Edge
from regions.models import Jurisdiction, Region

DEMO_DEPLOYMENT = "demo-chat"


@dataclass(frozen=True)
class LabFleet:
    """What the lab serves with one engine kind: the demo deployment's model and bounds."""

    engine: str
    model: str
    served_model_name: str
    regions: int  # the first N lab regions
    max_model_len: int
    max_replicas: int | None  # None: twice the starting count, at least 8
    autoscale: bool


FLEETS = {
    # Simulated engines are cheap: three regions, an 8B model, the autoscaler free to act.
    "enginesim": LabFleet("enginesim", "llama-3.1-8b-instruct", "llama-3.1-8b", 3, 8192, None,
                          True),
    # Real vLLM engines (CPU build) need a core and about 3 GB each: two regions, one engine
    # each, SmolLM2-135M-Instruct, and no autoscaling past what the machine holds.
    "vllm": LabFleet("vllm", "smollm2-135m-instruct", "smollm2-135m-instruct", 2, 2048, 2,
                     False),
}


@dataclass(frozen=True)
class LabEdge:
    name: str
    region: str  # local:<code>
    port: int
    admin_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


def lab_edges(base_port: int) -> list[LabEdge]:
    """Two edges, in the first two lab regions (Europe and North America)."""
    return [
        LabEdge(f"edge-{lab.code.split('-')[0]}", f"local:{lab.code}", base_port + i,
                base_port + 10 + i)
        for i, lab in enumerate(LAB_REGIONS[:2])
    ]


@dataclass(frozen=True)
class FleetStart:
    """What `ensure_fleet` did: the demo deployment, the replicas it requested (the engines
    the lab waits for), and the layout it brought back (empty: it seeded the lab instead)."""

    deployment: Deployment
    requested: list[Replica]
    restored: Layout


@transaction.atomic
def ensure_fleet(edges: list[LabEdge], replicas_per_region: int | None, actor: str,
                 fleet: LabFleet = FLEETS["enginesim"]) -> FleetStart:
    """Regions, the demo deployment (shared), its replicas, and the edge registry rows.

    Replicas: the layout the last run kept (controlplane/lab/layout.py) when there is one,
    each deployment topped up to its count in each region, a region it had none in left at
    none; otherwise `replicas_per_region` (1 when None) of the demo deployment in each region.
    A number given for `replicas_per_region` sets the demo deployment's count in every region
    even where a layout was kept; other deployments still get theirs back.

    A lab restarted with another engine turns the demo deployment over to it (the earlier
    run's replicas were stopped at start), seeds it afresh, and disables the lab regions it
    does not use.
    """
    regions = _enable_lab_regions(fleet)
    per_region = 1 if replicas_per_region is None else replicas_per_region
    deployment, fresh = _demo_deployment(fleet, regions, per_region * len(regions))
    layout = last_layout()
    restored: Layout = {}
    if fresh or replicas_per_region is not None or not layout:
        requested = _top_up(deployment, regions, {r.key: per_region for r in regions}, actor,
                            "lab start")
    else:
        restored[DEMO_DEPLOYMENT] = layout.get(DEMO_DEPLOYMENT, {})
        requested = _top_up(deployment, regions, restored[DEMO_DEPLOYMENT], actor,
                            "lab start: the layout that was running")
    for other in Deployment.objects.filter(name__in=set(layout) - {DEMO_DEPLOYMENT}):
        requested += _top_up(other, regions, layout[other.name], actor,
                             "lab start: the layout that was running")
        restored[other.name] = layout[other.name]
    _register_edges(edges)
    demo = Tenant.objects.get(name="demo")
    demo.allowed_jurisdictions.add(*{r.jurisdiction for r in regions})
    return FleetStart(deployment, requested, restored)


def _enable_lab_regions(fleet: LabFleet) -> list[Region]:
    """The first `fleet.regions` lab regions, enabled; the other local regions disabled."""
    regions = ensure_lab_regions(LAB_REGIONS[:fleet.regions])
    Region.objects.filter(cloud__name="local").exclude(pk__in=[r.pk for r in regions]).update(
        enabled=False)
    Region.objects.filter(pk__in=[r.pk for r in regions]).update(enabled=True)
    return regions


def _demo_deployment(fleet: LabFleet, regions: list[Region],
                     count: int) -> tuple[Deployment, bool]:
    """The demo deployment, created or turned over to `fleet`'s engine, and whether it is
    fresh (created or switched: it is seeded rather than given its layout back)."""
    settings = {
        "served_model_name": fleet.served_model_name,
        "model": Model.objects.get(name=fleet.model),
        "engine": fleet.engine,
        "min_replicas": count,
        "max_replicas": fleet.max_replicas or max(8, count * 2),
        "spread_regions": len(regions),
        "max_model_len": fleet.max_model_len,
        "autoscale": fleet.autoscale,
    }
    deployment, created = Deployment.objects.get_or_create(
        name=DEMO_DEPLOYMENT,
        defaults={**settings, "slo_ttft_p95_ms": 800, "slo_itl_p95_ms": 50,
                  "demand_tokens_per_s": 2000},
    )
    switched = not created and deployment.engine != fleet.engine
    if switched:
        for field, value in settings.items():
            setattr(deployment, field, value)
        deployment.placement_problem, deployment.placement_problem_since = "", None
        deployment.save()
    # Where it may run and whom it serves follow the lab's regions (a lab that ran with
    # another engine used fewer of them).
    deployment.allowed_jurisdictions.add(
        *Jurisdiction.objects.filter(code__in={r.jurisdiction.code for r in regions}))
    if created or switched or set(deployment.user_regions.all()) != set(regions):
        deployment.user_regions.set(regions)
    return deployment, created or switched


def _register_edges(edges: list[LabEdge]) -> None:
    """The edge registry's rows for the lab's edges, enabled."""
    for edge in edges:
        cloud, code = edge.region.split(":")
        Edge.objects.update_or_create(
            name=edge.name,
            defaults={"region": Region.objects.get(cloud__name=cloud, code=code),
                      "admin_url": edge.admin_url, "public_url": edge.url, "enabled": True},
        )


def _top_up(deployment: Deployment, regions: list[Region], counts: dict[str, int], actor: str,
            reason: str) -> list[Replica]:
    """Request what `deployment` lacks of `counts` (region key -> replicas) in each of the lab's
    regions (a kept count in a region the lab no longer runs is dropped); live replicas
    already there count, so running this twice requests nothing more."""
    made: list[Replica] = []
    for region in regions:
        wanted = counts.get(region.key, 0)
        live = deployment.replicas.filter(region=region, state__in=STAYING_STATES).count()
        if live < wanted:
            made += request_replicas(deployment, region, wanted - live, actor=actor,
                                     reason=reason)
    return made


def edge_certificate(edge: LabEdge, var_dir: Path) -> Path:
    """The edge's client certificate for engines, from the engine CA, in its own directory
    (renewed there by core.renew_certificates; the edge re-reads it)."""
    directory = var_dir / "lab" / "edges" / edge.name / "tls"
    certificates.ensure_installed(f"edge:{edge.name}", "client", edge.name, [], directory)
    return directory


def edge_argv(python: str, edge: LabEdge, var_dir: Path, public_key: Path,
              control_plane: str, token_file: Path, tls: Path | None = None) -> list[str]:
    """`python -m edge` for a lab edge: mTLS to engines with the files in `tls`, or plain
    HTTP (--plain-upstream, tests' fake engines only) without them."""
    upstream = (["--upstream-cert", str(tls / "cert.pem"), "--upstream-key",
                 str(tls / "key.pem"), "--upstream-ca", str(tls / "ca.pem")]
                if tls is not None else ["--plain-upstream"])
    return [
        python, "-m", "edge", "--name", edge.name, "--region", edge.region,
        "--listen", f"127.0.0.1:{edge.port}", "--admin-listen", f"127.0.0.1:{edge.admin_port}",
        "--state-dir", str(var_dir / "lab" / "edges" / edge.name),
        "--admin-secret-file", str(admin_secret_path(var_dir, edge.name)),
        "--public-key", str(public_key), "--control-plane", control_plane,
        "--control-plane-token-file", str(token_file), *upstream,
    ]


def admin_secret_path(var_dir: Path, edge_name: str) -> Path:
    return var_dir / "lab" / "edges" / edge_name / "admin-secret"


def write_admin_secrets(edges: list[LabEdge], var_dir: Path) -> None:
    """Each edge's admin secret (routing/edge_secrets.py) in a file only its owner reads, and
    a map from admin URL to secret file for the lab's own tools (`child_lab.edge_admin_get`)."""
    known = {}
    for edge in edges:
        path = admin_secret_path(var_dir, edge.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(edge_secret(edge.name))
        known[edge.admin_url] = str(path)
    (var_dir / "lab" / "edge-admin.json").write_text(json.dumps(known))


def stop_local_replicas(keep_empty: bool = True) -> list[str]:
    """Terminate every live replica in a local region (their processes outlive the worker),
    first keeping their layout for the next start (controlplane/lab/layout.py); with
    `keep_empty` false, a layout is kept only when some replica was live (the start's
    clean-up of a killed lab's leftovers must not forget the layout the last stop kept)."""
    close_old_connections()
    layout = running_layout()
    if layout or keep_empty:
        record_layout(layout, "lab stopped: its replicas come back on the next start")
    stopped = []
    for replica in Replica.objects.filter(region__cloud__name="local", state__in=LIVE_STATES):
        services.terminate(replica.pk, actor="lab", reason="lab stopped")
        stopped.append(replica.public_id)
    services.reap_unowned()
    return stopped
