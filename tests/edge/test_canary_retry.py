"""A failing canary costs its clients nothing: a request on the canary's share that fails
before its first byte (a 500, a refused connection, or every canary replica ejected) is
retried on the stable revision's replicas, and the failed attempt is counted against the
canary's revision, so that its rollout's analysis still sees it fail."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge.policy import pick_revision

from .conftest import TableFactory, replica
from .fake_engine import FakeEngine
from .helpers import running_edge
from .test_revisions import CANARY, STABLE, conversation, parse_table_shares, point_of


def on_canary(i: int, share: float) -> bool:
    return pick_revision(parse_table_shares(share), point_of(conversation(i))) == CANARY


def revision_counts(text: str) -> dict[tuple[str, str], float]:
    counts: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith('meridian_edge_revision_requests_total{model="m"'):
            labels, value = line.rsplit(" ", 1)
            revision = labels.split('revision="')[1].split('"')[0]
            status = labels.split('status="')[1].split('"')[0]
            counts[(revision, status)] = float(value)
    return counts


def test_a_canary_answering_500_before_its_first_byte_is_retried_on_stable(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    share = 50.0

    async def scenario() -> tuple[Counter[tuple[bool, int, str]], str, int]:
        stable = [FakeEngine("m"), FakeEngine("m")]
        canary = FakeEngine("m")
        canary.behaviour.status = 500  # the bad revision fails everything, at once
        for engine in [*stable, canary]:
            await engine.start()
        try:
            table = make_table(models={"m": [
                replica("stable-a", stable[0].url, revision=STABLE),
                replica("stable-b", stable[1].url, revision=STABLE),
                replica("canary", canary.url, revision=CANARY),
            ]})
            table["models"]["m"]["revisions"] = {STABLE: 100.0 - share, CANARY: share}
            async with running_edge(signing_key, state_dir) as edge:
                status, body = await edge.push(table, signing_key)
                assert status == 200, body
                got: Counter[tuple[bool, int, str]] = Counter()
                for i in range(40):
                    response = await edge.chat("m", messages=conversation(i), stream=(i % 2 == 0))
                    await response.read()
                    got[(on_canary(i, share), response.status,
                         response.headers.get("x-meridian-replica", ""))] += 1
                async with edge.session.get(edge.admin_url + "/metrics") as answer:
                    text = await answer.text()
            return got, text, len(canary.requests)
        finally:
            for engine in [*stable, canary]:
                await engine.stop()

    got, text, canary_saw = asyncio.run(scenario())
    # Every client got its answer from a stable replica, those on the canary's share too.
    assert {status for (_, status, _) in got} == {200}
    assert {served for (_, _, served) in got} <= {"stable-a", "stable-b"}
    canary_share = sum(n for (c, _, _), n in got.items() if c)
    assert canary_share > 5 and canary_saw > 0
    # The canary's failures still count against it: its own 500s until it is ejected, the
    # edge's 503s for the requests it could not take after; every request once more, by
    # the stable replica that answered it.
    counts = revision_counts(text)
    assert counts.get((CANARY, "500"), 0) == canary_saw
    assert counts.get((CANARY, "500"), 0) + counts.get((CANARY, "503"), 0) == canary_share
    assert counts.get((STABLE, "200"), 0) == sum(got.values())
    assert (CANARY, "200") not in counts


def test_a_canary_that_refuses_connections_is_retried_on_stable(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> Counter[tuple[int, str]]:
        stable = FakeEngine("m")
        await stable.start()
        try:
            table = make_table(models={"m": [
                replica("stable", stable.url, revision=STABLE),
                replica("canary", "http://127.0.0.1:9", revision=CANARY),  # nothing listens
            ]})
            table["models"]["m"]["revisions"] = {STABLE: 0.0, CANARY: 100.0}
            async with running_edge(signing_key, state_dir) as edge:
                status, body = await edge.push(table, signing_key)
                assert status == 200, body
                got: Counter[tuple[int, str]] = Counter()
                for i in range(6):
                    response = await edge.chat("m", messages=conversation(i))
                    await response.read()
                    got[(response.status, response.headers.get("x-meridian-replica", ""))] += 1
            return got
        finally:
            await stable.stop()

    # A revision at share 0 takes nothing new, but it is where a failed request goes when
    # no other revision has a replica: a rollout at 100% falls back on the stable one.
    assert asyncio.run(scenario()) == Counter({(200, "stable"): 6})
