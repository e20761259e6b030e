"""Latency counts successful answers only: an error body is written at once, so a revision
(or a model) answering nothing but 5xx would otherwise show the fastest TTFT of all — a
canary at 100% 5xx showed a TTFT p95 of 2 ms on its rollout page. Its requests and their
statuses are still counted, and that error rate is what stands beside the latency."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .conftest import TableFactory, replica
from .fake_engine import FakeEngine
from .helpers import running_edge
from .test_revisions import CANARY, STABLE, conversation


def series(text: str) -> dict[str, float]:
    return {key: float(value) for key, value in
            (line.rsplit(" ", 1) for line in text.splitlines()
             if line.startswith("meridian_edge_") and not line.startswith("#"))}


def test_error_answers_add_no_latency_and_successes_do(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> str:
        failing = [FakeEngine("m"), FakeEngine("m")]  # both revisions answer only 500
        for engine in failing:
            engine.behaviour.status = 500
        good = FakeEngine("ok")
        for engine in [*failing, good]:
            await engine.start()
        try:
            table = make_table(models={"m": [
                replica("stable", failing[0].url, revision=STABLE),
                replica("canary", failing[1].url, revision=CANARY),
            ]})
            table["models"]["m"]["revisions"] = {STABLE: 50.0, CANARY: 50.0}
            table["models"]["ok"] = {"replicas": [replica("ok-1", good.url)]}
            async with running_edge(signing_key, state_dir) as edge:
                status, body = await edge.push(table, signing_key)
                assert status == 200, body
                for i in range(12):
                    response = await edge.chat("m", messages=conversation(i))
                    await response.read()
                    assert response.status >= 500
                for _ in range(3):
                    response = await edge.chat("ok")
                    await response.read()
                    assert response.status == 200
                async with edge.session.get(edge.admin_url + "/metrics") as answer:
                    return await answer.text()
        finally:
            for engine in [*failing, good]:
                await engine.stop()

    got = series(asyncio.run(scenario()))
    # The failures are counted, by revision and status: the error rate is there to read.
    failed = sum(n for key, n in got.items()
                 if key.startswith('meridian_edge_revision_requests_total{model="m"'))
    assert failed >= 12
    # No latency for them, by revision or by model; the model that answered has its own.
    for revision in (STABLE, CANARY):
        assert got.get('meridian_edge_revision_time_to_first_token_seconds_count'
                       f'{{model="m",revision="{revision}"}}', 0) == 0
    assert got.get('meridian_edge_time_to_first_token_seconds_count{model="m"}', 0) == 0
    assert got['meridian_edge_time_to_first_token_seconds_count{model="ok"}'] == 3
