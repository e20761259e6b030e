"""A local replica launched through the provisioning service with mTLS on: a server
certificate from the engine CA (its identity and address), vLLM's TLS flags on enginesim,
its own engine key in its environment and not on its command line, readiness through the
control plane's client certificate; the table carries the key and the certificate's name,
and an edge with its own certificate serves through it. Without a certificate, nothing."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.utils import timezone

from controlplane.core import certificates
from controlplane.core.engine_keys import engine_key
from controlplane.core.models import Certificate
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.lab.waiting import wait_until
from controlplane.provisioning import services
from controlplane.routing.services import replica_views
from edge.local import build_table, replica_entry
from edge.upstream_tls import UpstreamTLS
from regions.models import Cloud, Offer, Quota, Region
from tests.edge.helpers import running_edge
from tests.engine_ca import engine_ca
from tests.mtls import answer

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("enginesim")]
__all__ = ["engine_ca"]


@pytest.fixture
def tls_replica(catalog, settings, engine_ca, tmp_path, local_provider):  # type: ignore[no-untyped-def]
    settings.ENGINE_TLS = True
    settings.VAR_DIR = tmp_path / "var"
    local_provider.tls_client = certificates.client_context
    cloud = Cloud.objects.create(name="local", display_name="Local lab")
    real = catalog["fra"]
    region = Region.objects.create(
        cloud=cloud, code="eu-frankfurt", display_name="Lab Frankfurt", latitude=real.latitude,
        longitude=real.longitude, country=real.country, jurisdiction=catalog["eu"])
    offer = Offer.objects.create(region=region, gpu_type=catalog["h100"], gpus_per_node=1,
                                 instance_type="enginesim", on_demand_usd_h=4,
                                 observed_at=timezone.now())
    Quota.objects.create(region=region, gpu_type=catalog["h100"], limit_gpus=8,
                         observed_at=timezone.now())
    deployment = Deployment.objects.create(
        name="demo", served_model_name="llama-3.1-8b", model=catalog["llama8b"],
        min_replicas=1, max_replicas=1, max_model_len=4096, engine="enginesim")
    replica = Replica.objects.create(deployment=deployment, region=region, offer=offer,
                                     provider="local")
    services.set_provider("local", local_provider)
    try:
        services.launch(replica.pk)
        wait_until(lambda: services.check(replica.pk) == S.READY, 60, "the replica ready")
        yield Replica.objects.get(pk=replica.pk)
    finally:
        services.set_provider("local", None)


def test_the_replica_runs_with_mtls_and_its_own_key(tls_replica, local_provider,  # type: ignore[no-untyped-def]
                                                    engine_ca) -> None:  # type: ignore[no-untyped-def]
    replica = tls_replica
    record = local_provider.read_record(replica.public_id)
    assert replica.url.startswith("https://127.0.0.1:")
    argv = " ".join(record["cmdline"])
    assert "--ssl-cert-reqs 2" in argv and "--ssl-ca-certs" in argv
    key = engine_key(replica.public_id)
    assert key not in argv
    environ = Path(f"/proc/{record['pid']}/environ").read_bytes().split(b"\0")
    assert f"VLLM_API_KEY={key}".encode() in environ
    cert = Certificate.objects.get(subject=f"replica:{replica.public_id}")
    assert cert.kind == "server"
    assert cert.addresses[0] == f"{replica.public_id}.replicas.meridian"
    assert "127.0.0.1" in cert.addresses
    host, port = replica.url.removeprefix("https://").split(":")
    # No client certificate: no path answers, /metrics and /health included.
    bare = ssl.create_default_context(cafile=str(engine_ca / "ca.pem"))
    bare.check_hostname = False
    for path in ("/health", "/metrics", "/v1/models"):
        assert isinstance(answer(host, int(port), "GET", path, bare), str), path
    # The control plane's own certificate: /metrics answers; /v1 wants the replica's key.
    mine = certificates.client_context()
    assert answer(host, int(port), "GET", "/metrics", mine) == 200
    assert answer(host, int(port), "GET", "/v1/models", mine) == 401


def test_an_edge_with_its_certificate_serves_through_the_table(  # type: ignore[no-untyped-def]
        tls_replica, tmp_path) -> None:
    (view,) = [v for v in replica_views() if v.id == tls_replica.public_id]
    assert view.engine_key == engine_key(tls_replica.public_id)
    assert view.tls_name == f"{tls_replica.public_id}.replicas.meridian"
    edge_dir = tmp_path / "edge-tls"
    row, _ = certificates.issue("edge:edge-test", "client", "edge-test", [], edge_dir)
    bundle = certificates.Bundle(edge_dir)
    key = Ed25519PrivateKey.generate()
    table = build_table(1, "edge-test", {"llama-3.1-8b": [replica_entry(
        view.id, view.urls_by_region.get("local:eu-frankfurt", view.url),
        engine_key=view.engine_key, tls_name=view.tls_name)]},
        {"sk-test": {"tenant": "acme", "jurisdictions": ["*"], "models": ["*"]}})

    async def scenario() -> None:
        async with running_edge(key, tmp_path / "state", upstream_tls=UpstreamTLS(
                bundle.cert, bundle.key, bundle.ca)) as edge:
            status, body = await edge.push(table, key)
            assert status == 200, body
            response = await edge.chat("llama-3.1-8b", "hello over mTLS", max_tokens=4)
            assert response.status == 200, await response.text()
            # Revoked (the next table lists it): the edge stops presenting its certificate.
            status, body = await edge.push({**table, "version": 2,
                                            "revoked_certificates": [row.serial]}, key)
            assert status == 200, body
            edge.edge.pool.close_origins(lambda _: False)  # no pooled connection helps
            refused = await edge.chat("llama-3.1-8b", "hello again", max_tokens=4)
            assert refused.status in (502, 503)
            assert edge.edge.metrics.upstream_tls_failures.get(("revoked",)) >= 1

    asyncio.run(scenario())
