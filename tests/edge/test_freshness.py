"""Table freshness: a replayed (earlier-issued) table is refused; a stale table keeps being
served under "last_known_good" and serves only fail-open tenants under "fail_closed"; keys
revoked in any verified table stay refused, across restarts and older tables."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge.revocations import REVOKED_FILE

from .conftest import TableFactory, tenant
from .helpers import EdgeUnderTest, running_edge


def issued(seconds_ago: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - seconds_ago))


async def models_status(edge: EdgeUnderTest, key: str) -> tuple[int, Any]:
    async with edge.session.get(edge.url + "/v1/models",
                                headers={"authorization": f"Bearer {key}"}) as response:
        return response.status, await response.json()


def test_a_table_issued_before_the_served_one_is_a_replay(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            assert (await edge.push(make_table(version=2), signing_key))[0] == 200
            older = make_table(version=3)
            older["issued_at"] = issued(3600)
            status, answer = await edge.push(older, signing_key)
            assert (status, answer["error"]["code"], answer["error"]["param"]) == (
                409, "issued_before_served", "issued_at")
            assert edge.edge.table is not None and edge.edge.table.version == 2
            bad = make_table(version=4)
            bad["issued_at"] = "yesterday"
            status, answer = await edge.push(bad, signing_key)
            assert (status, answer["error"]["param"]) == (400, "issued_at")

    asyncio.run(scenario())


def stale_table(make_table: TableFactory, mode: str | None) -> dict[str, Any]:
    policy: dict[str, Any] = {"max_table_age_s": 3600}
    if mode is not None:
        policy["stale_table_mode"] = mode
    table = make_table(version=5, policy=policy, tenants={
        "sk-closed": tenant("acme"), "sk-open": tenant("hospital", fail_open=True)})
    table["issued_at"] = issued(7200)
    return table


def test_a_stale_table_is_still_served_to_everyone_by_default(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            assert (await edge.push(stale_table(make_table, None), signing_key))[0] == 200
            assert (await models_status(edge, "sk-closed"))[0] == 200
            async with edge.session.get(edge.admin_url + "/healthz") as response:
                health = await response.json()
            assert response.status == 200
            assert (health["table_state"], health["stale_table_mode"], health["serving"]) == (
                "stale", "last_known_good", "all_tenants")
            assert health["table_age_s"] >= 7200
            async with edge.session.get(edge.admin_url + "/metrics") as response:
                text = await response.text()
            assert 'meridian_edge_table_stale{mode="last_known_good"} 1' in text

    asyncio.run(scenario())


def test_a_stale_table_under_fail_closed_serves_only_fail_open_tenants(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            assert (await edge.push(stale_table(make_table, "fail_closed"), signing_key)
                    )[0] == 200
            status, answer = await models_status(edge, "sk-closed")
            assert (status, answer["error"]["code"]) == (503, "table_expired")
            assert "max_table_age_s (3600 s)" in answer["error"]["message"]
            assert (await models_status(edge, "sk-open"))[0] == 200
            async with edge.session.get(edge.admin_url + "/healthz") as response:
                health = await response.json()
            assert (health["table_state"], health["serving"]) == (
                "stale", "fail_open_tenants_only")
            # A fresh table lifts it at once.
            fresh = make_table(version=6, policy={"max_table_age_s": 3600,
                                                  "stale_table_mode": "fail_closed"},
                               tenants={"sk-closed": tenant("acme")})
            assert (await edge.push(fresh, signing_key))[0] == 200
            assert (await models_status(edge, "sk-closed"))[0] == 200

    asyncio.run(scenario())


def test_bad_freshness_settings_name_the_field(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            for version, policy, field in [
                    (1, {"max_table_age_s": 0}, "policy.max_table_age_s"),
                    (2, {"stale_table_mode": "open"}, "policy.stale_table_mode")]:
                status, answer = await edge.push(make_table(version=version, policy=policy),
                                                 signing_key)
                assert (status, answer["error"]["param"]) == (400, field)

    asyncio.run(scenario())


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_keys_revoked_in_any_verified_table_stay_refused(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    two_keys = {"sk-gone": tenant("acme"), "sk-kept": tenant("acme")}

    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            assert (await edge.push(make_table(version=1, tenants=two_keys), signing_key)
                    )[0] == 200
            assert (await models_status(edge, "sk-gone"))[0] == 200
            # A newer table this edge cannot take (a field it does not accept) still tells it
            # which keys were revoked: the last known good table keeps serving, less them.
            newer = make_table(version=2, tenants={"sk-kept": tenant("acme")})
            newer["revoked_keys"] = [key_hash("sk-gone")]
            newer["models"]["m"]["replicas"][0]["state"] = "warming"
            status, _ = await edge.push(newer, signing_key)
            assert status == 400
            assert edge.edge.table is not None and edge.edge.table.version == 1
            assert (await models_status(edge, "sk-gone"))[0] == 401
            assert (await models_status(edge, "sk-kept"))[0] == 200
        assert json.loads((state_dir / REVOKED_FILE).read_bytes()) == [key_hash("sk-gone")]
        # After a restart the table on disk (v1, which lists the key) is served without it.
        async with running_edge(signing_key, state_dir) as edge:
            assert edge.edge.table is not None and edge.edge.table.version == 1
            assert (await models_status(edge, "sk-gone"))[0] == 401
            assert (await models_status(edge, "sk-kept"))[0] == 200
            async with edge.session.get(edge.admin_url + "/healthz") as response:
                assert (await response.json())["revoked_keys"] == 1

    asyncio.run(scenario())
