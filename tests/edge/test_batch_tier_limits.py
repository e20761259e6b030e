"""Batch-tier requests spend a rate budget of their own (the tenant's limits again): a
tenant's batch never uses up its interactive budget, nor the other way round."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .conftest import API_KEY, replica, tenant
from .test_proxy import edge_with, engines, expect_error, run

__all__ = ["edge_with"]   # the fixture, used by name

BATCH = {"x-meridian-tier": "batch"}


def test_a_batch_has_its_own_rpm_budget_beside_the_interactive_one(
        edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url)]},
                tenants={API_KEY: tenant(rpm=2)}) as edge:
            assert (await edge.chat("m", headers=BATCH)).status == 200
            assert (await edge.chat("m", headers=BATCH)).status == 200
            refused = await edge.chat("m", headers=BATCH)
            error = await expect_error(429, "rate_limit_exceeded")(refused)
            assert error["type"] == "requests"
            # The batch spent its budget, not the tenant's interactive one.
            assert (await edge.chat("m")).status == 200
            assert (await edge.chat("m")).status == 200
            await expect_error(429, "rate_limit_exceeded")(await edge.chat("m"))
            assert len(engine.requests) == 4

    run(scenario())


def test_a_batch_keys_tier_has_its_own_tpm_budget(edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url)]},
                tenants={API_KEY: tenant(tpm=600),
                         "sk-batch": tenant(tpm=600, tier="batch")}) as edge:
            assert (await edge.chat("m", "x" * 2000, key="sk-batch")).status == 200
            await expect_error(429, "rate_limit_exceeded")(
                await edge.chat("m", "x" * 2000, key="sk-batch"))
            assert (await edge.chat("m", "x" * 2000)).status == 200   # interactive: untouched

    run(scenario())
