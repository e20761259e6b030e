"""Refusals cost the edge a bounded amount: requests naming models that do not exist share one
metric series whatever they name, and the tenant's rate limit is spent before the model is
looked up, so a flood of bad names from one key is limited like any other traffic."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .conftest import API_KEY, TableFactory, replica, tenant
from .fake_engine import FakeEngine
from .helpers import EdgeUnderTest, running_edge


def series(edge: EdgeUnderTest, name: str) -> list[str]:
    """The exposition's samples of one metric, as Prometheus would scrape them."""
    text = edge.edge.metrics.registry.render().decode()
    return [line for line in text.splitlines() if line.startswith(name + "{")]


@pytest.fixture
def edge_serving(signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory
                 ) -> Callable[..., Any]:
    @asynccontextmanager
    async def start(**tenant_rules: Any) -> AsyncIterator[tuple[EdgeUnderTest, FakeEngine]]:
        engine = FakeEngine("m")
        await engine.start()
        try:
            async with running_edge(signing_key, state_dir) as edge:
                status, body = await edge.push(make_table(
                    models={"m": [replica("r1", engine.url)]},
                    tenants={API_KEY: tenant(**tenant_rules)}), signing_key)
                assert status == 200, body
                yield edge, engine
        finally:
            await engine.stop()

    return start


def test_requests_naming_unknown_models_share_one_series(edge_serving: Callable[..., Any]
                                                         ) -> None:
    async def scenario() -> None:
        async with edge_serving() as (edge, engine):
            assert (await edge.chat("m")).status == 200
            for n in range(20):
                assert (await edge.chat(f"no-such-model-{n}")).status == 404
            assert (await edge.chat("m", key="sk-wrong")).status == 401
            first = series(edge, "meridian_edge_requests_total")
            for n in range(20, 220):
                assert (await edge.chat(f"no-such-model-{n}")).status == 404
                assert (await edge.chat(f"also-not-{n}", key="sk-wrong")).status == 401
            after = series(edge, "meridian_edge_requests_total")
            # 420 more refusals naming 400 more models: the same series, only their counts grew.
            assert [line.rsplit(" ", 1)[0] for line in after] == \
                [line.rsplit(" ", 1)[0] for line in first]
            assert len(after) == 3, after
            assert 'meridian_edge_requests_total{model="unknown",region="",tenant="acme",' \
                   'status="404"} 220' in after
            assert 'meridian_edge_requests_total{model="unknown",region="",tenant="",' \
                   'status="401"} 201' in after
            assert not any("no-such-model" in line or "also-not" in line
                           for line in edge.edge.metrics.registry.render().decode().splitlines())
            assert len(engine.requests) == 1

    asyncio.run(scenario())


def test_a_flood_of_unknown_models_is_rate_limited_before_the_model_is_looked_up(
        edge_serving: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with edge_serving(rpm=3) as (edge, engine):
            for n in range(3):
                assert (await edge.chat(f"made-up-{n}")).status == 404
            refused = await edge.chat("made-up-3")
            body = await refused.json()
            assert refused.status == 429, body
            assert body["error"]["code"] == "rate_limit_exceeded"
            assert "limit 3" in body["error"]["message"]  # the refusal names the limit
            assert int(refused.headers["retry-after"]) >= 1
            # The key's budget is spent: a real model is refused too, and nothing reached
            # the engine.
            assert (await edge.chat("m")).status == 429
            assert engine.requests == []
            assert edge.edge.metrics.rate_limited.get(("acme", "requests")) == 2
            assert series(edge, "meridian_edge_requests_total") == [
                'meridian_edge_requests_total{model="unknown",region="",tenant="acme",'
                'status="404"} 3',
                'meridian_edge_requests_total{model="unknown",region="",tenant="acme",'
                'status="429"} 2']

    asyncio.run(scenario())


def test_a_request_over_the_limit_for_a_known_model_is_counted_like_any_refusal(
        edge_serving: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with edge_serving(rpm=1) as (edge, engine):
            # The second request takes the remembered route (the fast path): same label.
            assert (await edge.chat("m")).status == 200
            assert (await edge.chat("m")).status == 429
            assert series(edge, "meridian_edge_requests_total") == [
                'meridian_edge_requests_total{model="m",region="local:lab-1",tenant="acme",'
                'status="200"} 1',
                'meridian_edge_requests_total{model="unknown",region="",tenant="acme",'
                'status="429"} 1']
            assert len(engine.requests) == 1

    asyncio.run(scenario())
