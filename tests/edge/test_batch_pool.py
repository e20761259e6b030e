"""Batch pools: a model whose table names a `batch_pool` (it has a batch-tier deployment)
takes batch requests on its batch-tier replicas alone, and interactive ones never there;
with no batch-tier replica the edge answers a batch request 503 no_replicas and counts it
(what wakes a pool scaled to zero) rather than sending it to an interactive replica."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge.local import build_table, replica_entry
from edge.policy import in_batch_pool
from edge.table import Replica, TableError, TenantRules, parse_origin, parse_table

from .conftest import API_KEY, tenant
from .fake_engine import FakeEngine
from .helpers import running_edge

BATCH = {"x-meridian-tier": "batch"}


def _replica(rid: str, tier: str) -> Replica:
    return Replica(rid, "m", "http://127.0.0.1:9", parse_origin("http://127.0.0.1:9"),
                   "local:lab-1", "EU", tier=tier)


ACME = TenantRules("acme", frozenset({"EU"}))
BOTH = (_replica("r-i", "interactive"), _replica("r-b", "batch"))


@pytest.mark.parametrize(
    ("pool", "tier", "expected", "why"),
    [
        (None, "batch", ["r-i", "r-b"], "no pool: batch work may use interactive replicas"),
        (frozenset({"*"}), "batch", ["r-b"], "a shared pool takes every tenant's batch work"),
        (frozenset({"acme"}), "batch", ["r-b"], "a pool of acme's takes acme's batch work"),
        (frozenset({"globex"}), "batch", ["r-i", "r-b"], "another tenant's pool is not acme's"),
        (frozenset({"*"}), "interactive", ["r-i", "r-b"],
         "interactive work is not narrowed here (the tier filter keeps it off batch replicas)"),
    ],
)
def test_which_replicas_a_request_may_use(pool: Any, tier: str, expected: list[str],
                                          why: str) -> None:
    assert [r.id for r in in_batch_pool(BOTH, pool, ACME, tier)] == expected, why


def test_a_batch_pool_is_read_with_the_table_and_a_malformed_one_refused_by_name() -> None:
    def table(pool: Any) -> dict[str, Any]:
        document = build_table(1, "edge-test", {"m": []}, {API_KEY: tenant()})
        if pool is not None:
            document["models"]["m"]["batch_pool"] = pool
        return document

    assert parse_table(table(None)).batch_pools == {}
    assert parse_table(table(["*"])).batch_pools == {"m": frozenset({"*"})}
    for bad in ("acme", [], [""], [3]):
        with pytest.raises(TableError) as refused:
            parse_table(table(bad))
        assert refused.value.field == "models.m.batch_pool", bad


def _table(interactive_url: str, batch_url: str | None, pool: list[str] | None,
           version: int = 1) -> dict[str, Any]:
    replicas = [replica_entry("r-i", interactive_url)]
    if batch_url is not None:
        replicas.append(replica_entry("r-b", batch_url, tier="batch"))
    table = build_table(version, "edge-test", {"m": replicas}, {API_KEY: tenant()})
    if pool is not None:
        table["models"]["m"]["batch_pool"] = pool
    return table


def test_batch_work_goes_to_the_pool_and_interactive_work_never_does(
        signing_key: Ed25519PrivateKey, state_dir: Path) -> None:
    async def scenario() -> None:
        interactive, pooled = FakeEngine("m"), FakeEngine("m")
        await interactive.start()
        await pooled.start()
        try:
            async with running_edge(signing_key, state_dir) as edge:
                status, body = await edge.push(_table(interactive.url, pooled.url, ["*"]),
                                               signing_key)
                assert status == 200, body
                for _ in range(4):
                    assert (await edge.chat("m", "chat")).status == 200
                    assert (await edge.chat("m", "line", headers=BATCH)).status == 200
                assert [r["messages"][0]["content"] for r in interactive.requests] == ["chat"] * 4
                assert [r["messages"][0]["content"] for r in pooled.requests] == ["line"] * 4
        finally:
            await interactive.stop()
            await pooled.stop()

    asyncio.run(scenario())


def test_a_pool_with_no_replica_answers_batch_work_503_and_counts_it(
        signing_key: Ed25519PrivateKey, state_dir: Path) -> None:
    async def scenario() -> None:
        interactive = FakeEngine("m")
        await interactive.start()
        try:
            async with running_edge(signing_key, state_dir) as edge:
                status, body = await edge.push(_table(interactive.url, None, ["*"]), signing_key)
                assert status == 200, body
                refused = await edge.chat("m", "line", headers=BATCH)
                error = (await refused.json())["error"]
                assert (refused.status, error["code"]) == (503, "no_replicas")
                assert (await edge.chat("m", "chat")).status == 200
                assert [r["messages"][0]["content"] for r in interactive.requests] == ["chat"]
                # Counted with no replica region: what the autoscaler wakes a pool on.
                async with edge.session.get(edge.admin_url + "/metrics") as response:
                    metrics = await response.text()
                assert ('meridian_edge_requests_total{model="m",region="",tenant="acme",'
                        'status="503"} 1') in metrics

                # Without a pool (no batch-tier deployment), batch work shares the
                # interactive replicas, as before.
                status, body = await edge.push(_table(interactive.url, None, None, 2),
                                               signing_key)
                assert status == 200, body
                assert (await edge.chat("m", "line", headers=BATCH)).status == 200
                assert [r["messages"][0]["content"] for r in interactive.requests] == [
                    "chat", "line"]
        finally:
            await interactive.stop()

    asyncio.run(scenario())
