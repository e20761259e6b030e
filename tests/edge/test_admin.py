"""The admin API: only signed, newer tables for this edge are taken; they are on disk before
the 200; a restarted edge serves its last-known-good table; metrics and health."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge.table import TABLE_FILE, canonical_bytes, sign_table

from .conftest import TableFactory
from .helpers import EdgeUnderTest, running_edge, signed_body


async def served(edge: EdgeUnderTest) -> dict[str, Any]:
    status, summary = await edge.admin("GET", "/admin/table")
    assert status == 200
    return dict(summary)


def test_a_signed_newer_table_is_persisted_then_served(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            assert (await served(edge))["version"] is None
            status, body = await edge.push(make_table(version=3), signing_key)
            assert status == 200 and body["version"] == 3
            on_disk = json.loads((state_dir / TABLE_FILE).read_bytes())
            assert on_disk["version"] == 3 and on_disk["signature"]
            summary = await served(edge)
            assert (summary["version"], summary["hash"], summary["source"]) == (
                3, body["hash"], "push")

    asyncio.run(scenario())


def test_tampered_unsigned_foreign_and_older_tables_are_refused_and_change_nothing(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            status, accepted = await edge.push(make_table(version=5), signing_key)
            assert status == 200
            before = (state_dir / TABLE_FILE).read_bytes()

            tampered = sign_table(make_table(version=6), signing_key)
            tampered["models"]["m"]["replicas"][0]["url"] = "http://attacker.example:80"
            unsigned = make_table(version=7)
            foreign = sign_table(make_table(version=8), Ed25519PrivateKey.generate())
            attempts = [
                (canonical_bytes(tampered), 400, "bad_signature"),
                (canonical_bytes(unsigned), 400, "bad_signature"),
                (canonical_bytes(foreign), 400, "bad_signature"),
                (b"{not json", 400, "invalid_table"),
                (signed_body(make_table(version=9, edge="edge-elsewhere"), signing_key), 400,
                 "wrong_edge"),
                (signed_body(make_table(version=5), signing_key), 409, "version_not_newer"),
                (signed_body(make_table(version=4), signing_key), 409, "version_not_newer"),
            ]
            for body, want_status, want_code in attempts:
                status, answer = await edge.put_table(body)
                assert (status, answer["error"]["code"]) == (want_status, want_code), answer
                assert set(answer["error"]) == {"message", "type", "param", "code"}
            assert (state_dir / TABLE_FILE).read_bytes() == before
            summary = await served(edge)
            assert (summary["version"], summary["hash"]) == (5, accepted["hash"])
            async with edge.session.get(edge.admin_url + "/metrics") as response:
                text = await response.text()
            assert 'meridian_edge_table_rejections_total{reason="bad_signature"} 3' in text
            assert 'meridian_edge_table_rejections_total{reason="not_newer"} 2' in text
            assert "meridian_edge_table_version 5" in text

    asyncio.run(scenario())


def test_a_malformed_but_signed_table_names_the_field(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            table = make_table(version=2)
            table["models"]["m"]["replicas"][0]["max_inflight"] = -1
            status, answer = await edge.push(table, signing_key)
            assert status == 400
            assert answer["error"]["param"] == "models.m.replicas[0].max_inflight"
            assert not (state_dir / TABLE_FILE).exists()

    asyncio.run(scenario())


def test_restart_serves_the_last_known_good_table(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            status, first = await edge.push(make_table(version=11), signing_key)
            assert status == 200
        async with running_edge(signing_key, state_dir) as edge:
            summary = await served(edge)
            assert (summary["version"], summary["hash"], summary["source"]) == (
                11, first["hash"], "disk")
            # And the rule against going back survives the restart.
            status, _ = await edge.push(make_table(version=10), signing_key)
            assert status == 409

    asyncio.run(scenario())


def test_an_edited_table_on_disk_is_not_served(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            assert (await edge.push(make_table(version=2), signing_key))[0] == 200
        document = json.loads((state_dir / TABLE_FILE).read_bytes())
        document["tenants"] = {}
        (state_dir / TABLE_FILE).write_bytes(canonical_bytes(document))
        async with running_edge(signing_key, state_dir) as edge:
            assert (await served(edge))["version"] is None
            async with edge.session.get(edge.admin_url + "/healthz") as response:
                assert response.status == 503

    asyncio.run(scenario())


def test_health_and_metrics_endpoints(signing_key: Ed25519PrivateKey, state_dir: Path,
                                      make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            await edge.push(make_table(version=4), signing_key)
            async with edge.session.get(edge.admin_url + "/healthz") as response:
                assert response.status == 200
                assert (await response.json())["table_version"] == 4
            async with edge.session.get(edge.admin_url + "/metrics") as response:
                assert response.headers["content-type"].startswith("text/plain")
                text = await response.text()
            for name in ("meridian_edge_requests_total", "meridian_edge_added_latency_seconds",
                         "meridian_edge_ejections_total", "meridian_edge_retries_total",
                         "meridian_edge_time_to_first_token_seconds"):
                assert f"# TYPE {name}" in text
            rows = (await edge.admin("GET", "/admin/replicas"))[1]["replicas"]
            assert [row["id"] for row in rows] == ["r1"]

    asyncio.run(scenario())
