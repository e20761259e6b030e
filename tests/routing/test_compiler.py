"""The table compiler: what each edge sees, table-driven."""

from __future__ import annotations

import pytest

from controlplane.routing.compiler import (
    EdgeView,
    PolicyView,
    ReplicaView,
    TenantKeyView,
    compile_table,
)
from regions.geo import great_circle_km, rtt_ms

FRANKFURT = (50.11, 8.68)
VIRGINIA = (38.95, -77.45)
POLICY = PolicyView({"latency": 1.0, "load": 2.0}, 2, 2, 1.0, {"auto": {"default": "m"}})
EDGE_EU = EdgeView("edge-eu", "local:eu-frankfurt", *FRANKFURT)


def replica(rid: str, state: str = "ready", lat_lon=FRANKFURT, **kw) -> ReplicaView:  # type: ignore[no-untyped-def]
    return ReplicaView(
        id=rid, model=kw.pop("model", "llama"), region=kw.pop("region", "local:eu-frankfurt"),
        jurisdiction=kw.pop("jurisdiction", "EU"), latitude=lat_lon[0], longitude=lat_lon[1],
        state=state, url=f"http://127.0.0.1:9/{rid}", **kw,
    )


def compile_for(edge: EdgeView, replicas: list[ReplicaView], keys=()):  # type: ignore[no-untyped-def]
    return compile_table(edge, replicas, list(keys), POLICY, version=7, issued_at="t", key_id="k")


def test_frankfurt_to_virginia_rtt_is_about_seventy_ms():
    km = great_circle_km(*FRANKFURT, *VIRGINIA)
    assert 6400 < km < 6600
    assert 63 < rtt_ms(km) < 66


@pytest.mark.parametrize(
    ("state", "expected_weight", "why"),
    [
        ("ready", 1.0, "ready replicas take full share"),
        ("degraded", 0.5, "degraded replicas take half"),
        ("draining", 0.0, "draining replicas finish in-flight work but get nothing new"),
        ("starting", None, "not-yet-ready replicas are left out"),
        ("failed", None, "failed replicas are left out"),
    ],
)
def test_state_decides_presence_and_weight(state, expected_weight, why):  # type: ignore[no-untyped-def]
    table = compile_for(EDGE_EU, [replica("r-1", state)])
    entries = table["models"].get("llama", {"replicas": []})["replicas"]
    if expected_weight is None:
        assert entries == [], why
    else:
        assert entries[0]["weight"] == expected_weight, why


def test_edge_gets_the_url_for_its_own_region_and_rtt_from_it():
    far = replica("r-2", lat_lon=VIRGINIA, region="local:us-virginia", jurisdiction="US",
                  urls_by_region={"local:eu-frankfurt": "http://127.0.0.1:7001"})
    entry = compile_for(EDGE_EU, [far])["models"]["llama"]["replicas"][0]
    assert entry["url"] == "http://127.0.0.1:7001"
    assert 63 < entry["rtt_ms"] < 66
    assert entry["jurisdiction"] == "US"


def test_tenants_are_keyed_by_hash_with_their_rules():
    key = TenantKeyView("ab" * 32, "acme", ("EU",), ("aws:eu-central-1",), 60, 1000, (), "batch")
    table = compile_for(EDGE_EU, [], [key])
    assert table["tenants"]["ab" * 32] == {
        "tenant": "acme", "jurisdictions": ["EU"], "regions": ["aws:eu-central-1"], "rpm": 60,
        "tpm": 1000, "models": ["*"], "tier": "batch", "resume_streams": True,
    }
    assert table["policy"]["scorers"] == {"latency": 1.0, "load": 2.0}
    assert (table["policy"]["resume_streams_max"], table["policy"]["resume_deadline_s"],
            table["policy"]["stream_stall_s"]) == (2, 30.0, 10.0)
    off = TenantKeyView("cd" * 32, "acme", ("EU",), (), 0, 0, (), "interactive",
                        resume_streams=False)
    assert compile_for(EDGE_EU, [], [off])["tenants"]["cd" * 32]["resume_streams"] is False
    assert table["aliases"] == {"auto": {"default": "m"}}
    assert (table["version"], table["edge"]) == (7, "edge-eu")


def test_dedicated_replicas_name_their_tenant():
    entry = compile_for(EDGE_EU, [replica("r-3", tenant="acme")])["models"]["llama"]["replicas"][0]
    assert entry["tenant"] == "acme"
    shared = compile_for(EDGE_EU, [replica("r-4")])["models"]["llama"]["replicas"][0]
    assert "tenant" not in shared


def test_two_deployments_of_one_served_name_share_a_pool_told_apart_by_tier():
    """Interactive and batch-tier deployments serving the same name: one model entry, each
    replica with its tier; without batch pools the edge may send batch work to both."""
    table = compile_for(EDGE_EU, [replica("r-i"), replica("r-b", tier="batch")])
    entry = table["models"]["llama"]
    assert [(r["id"], r["tier"]) for r in entry["replicas"]] == [("r-b", "batch"),
                                                                 ("r-i", "interactive")]
    assert "batch_pool" not in entry


@pytest.mark.parametrize(
    ("owners", "expected", "why"),
    [
        ([None], ["*"], "a shared batch-tier deployment takes every tenant's batch work"),
        (["globex", "acme"], ["acme", "globex"], "dedicated ones take their tenants' only"),
        (["acme", None], ["*"], "a shared one beside a dedicated one: everyone's"),
    ],
)
def test_a_batch_tier_deployment_makes_its_model_a_batch_pool(owners, expected, why):  # type: ignore[no-untyped-def]
    table = compile_table(EDGE_EU, [replica("r-i"), replica("r-b", tier="batch")], [], POLICY,
                          version=7, issued_at="t", key_id="k", batch_pools={"llama": owners})
    assert table["models"]["llama"]["batch_pool"] == expected, why
    assert len(table["models"]["llama"]["replicas"]) == 2


def test_a_batch_pool_scaled_to_zero_is_still_in_the_table():
    """No replica at all for the model: the entry stays, so the edge answers the batch
    runner 503 (and counts it, which wakes the deployment) rather than 404."""
    table = compile_table(EDGE_EU, [], [], POLICY, version=7, issued_at="t", key_id="k",
                          batch_pools={"llama": [None], "other": []})
    assert table["models"] == {"llama": {"replicas": [], "batch_pool": ["*"]}}


def test_a_replica_entry_carries_its_engine_key_and_certificate_name_for_the_edge():
    from edge.table import parse_table

    secured = replica("r-3", engine_key="sk-engine-r-3", tls_name="r-3.replicas.meridian")
    table = compile_table(EDGE_EU, [secured, replica("r-4")], [], POLICY, version=7,
                          issued_at="2026-11-27T12:00:00+00:00", key_id="k",
                          revoked_certificates=["1f", "0a"])
    first, second = table["models"]["llama"]["replicas"]
    assert (first["engine_key"], first["tls_name"]) == ("sk-engine-r-3", "r-3.replicas.meridian")
    assert "engine_key" not in second and "tls_name" not in second
    assert table["revoked_certificates"] == ["0a", "1f"]
    parsed = parse_table(table)  # the edge's own parser takes it
    assert parsed.revoked_certificates == {"0a", "1f"}
    r3 = parsed.models["llama"][0]
    assert r3.engine_authorization == b"authorization: Bearer sk-engine-r-3\r\n"
    assert r3.origin.server_name == "r-3.replicas.meridian"
    assert "revoked_certificates" not in compile_for(EDGE_EU, [secured])
