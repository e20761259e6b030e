"""Revision weights: the table's strict shape, the split by prefix key (shares within
tolerance over many conversations, one conversation always on one revision), a weight of 0
sending nothing to the canary, and tables without revisions routing as before."""

from __future__ import annotations

import asyncio
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge.policy import AFFINITY_BLOCKS, pick_revision, revision_key, revision_point
from edge.prefix import block_keys, conversation_key
from edge.table import TableError, parse_table

from .conftest import TableFactory, replica
from .fake_engine import FakeEngine
from .helpers import running_edge

STABLE, CANARY = "1", "2"
# A system prompt many blocks long, shared by every conversation.
SYSTEM = "You are a helpful assistant. Answer briefly and cite sources. " * 8


def split_table(make_table: TableFactory, canary_share: float, **extra: Any) -> dict[str, Any]:
    table = make_table(models={"m": [
        replica("stable-a", "http://127.0.0.1:9", revision=STABLE),
        replica("stable-b", "http://127.0.0.1:9", revision=STABLE),
        replica("canary", "http://127.0.0.1:9", revision=CANARY),
    ]}, **extra)
    table["models"]["m"]["revisions"] = {STABLE: 100.0 - canary_share, CANARY: canary_share}
    return table


@pytest.mark.parametrize(("revisions", "field"), [
    ({}, "models.m.revisions"),
    ([], "models.m.revisions"),
    ({STABLE: 0, CANARY: 0}, "models.m.revisions"),
    ({STABLE: -1, CANARY: 101}, "models.m.revisions.1"),
    ({STABLE: 95, CANARY: "5"}, "models.m.revisions.2"),
    ({STABLE: 95, CANARY: True}, "models.m.revisions.2"),
    ({STABLE: 100}, "models.m.replicas[2].revision"),  # the canary's revision is not listed
])
def test_bad_revisions_are_refused_naming_the_field(make_table: TableFactory, revisions: Any,
                                                    field: str) -> None:
    table = split_table(make_table, 5)
    table["models"]["m"]["revisions"] = revisions
    with pytest.raises(TableError) as caught:
        parse_table(table)
    assert caught.value.field == field


def test_a_replica_without_a_revision_is_refused_when_the_model_is_split(
        make_table: TableFactory) -> None:
    table = split_table(make_table, 5)
    del table["models"]["m"]["replicas"][0]["revision"]
    with pytest.raises(TableError) as caught:
        parse_table(table)
    assert caught.value.field == "models.m.replicas[0].revision"


def test_without_revisions_the_table_reads_as_before(make_table: TableFactory) -> None:
    table = parse_table(make_table(models={"m": [replica("r1"), replica("r2", revision="7")]}))
    assert table.revisions == {}
    assert [r.revision for r in table.models["m"]] == [None, "7"]


def conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Conversation {i}: tell me about topic {i * 7919}."}]


def later_turn(i: int) -> list[dict[str, str]]:
    return [*conversation(i), {"role": "assistant", "content": "Here is what I know. " * 20},
            {"role": "user", "content": "And a follow-up question?"}]


def point_of(messages: list[dict[str, str]]) -> float:
    key = conversation_key(messages)
    assert key is not None
    return revision_point(key)


@pytest.mark.parametrize("canary", [0.0, 1.0, 5.0, 25.0, 50.0, 75.0, 100.0])
def test_many_conversations_split_within_tolerance_of_the_weight(canary: float) -> None:
    shares = parse_table_shares(canary)
    n = 4000
    picked = Counter(pick_revision(shares, point_of(conversation(i))) for i in range(n))
    share = 100.0 * picked[CANARY] / n
    if canary in (0.0, 100.0):
        assert share == canary
    else:
        # binomial: 4 standard deviations, at least half a point
        tolerance = max(0.5, 4 * 100 * (canary / 100 * (1 - canary / 100) / n) ** 0.5)
        assert abs(share - canary) <= tolerance, (share, canary)


def parse_table_shares(canary: float) -> tuple[tuple[str, float], ...]:
    table = parse_table({"version": 1, "models": {"m": {
        "replicas": [{"id": "a", "url": "http://127.0.0.1:9", "region": "x",
                      "jurisdiction": "EU", "revision": STABLE},
                     {"id": "b", "url": "http://127.0.0.1:9", "region": "x",
                      "jurisdiction": "EU", "revision": CANARY}],
        "revisions": {STABLE: 100.0 - canary, CANARY: canary}}}})
    return table.revisions["m"]


def test_a_conversation_stays_on_its_revision_as_it_grows_and_as_the_canary_grows() -> None:
    for i in range(200):
        assert point_of(conversation(i)) == point_of(later_turn(i))
        on_canary = [pick_revision(parse_table_shares(w), point_of(conversation(i))) == CANARY
                     for w in (5.0, 25.0, 50.0, 100.0)]
        # Once on the canary, a larger share never moves it back.
        assert on_canary == sorted(on_canary)


def test_completions_are_keyed_by_their_first_blocks_or_their_whole_short_text() -> None:
    long_prompt = b"x" * 64 * 6
    keys = block_keys(long_prompt)
    assert revision_key(keys, long_prompt) == keys[AFFINITY_BLOCKS - 1]
    assert revision_key(block_keys(long_prompt + b"more" * 40), long_prompt) == keys[3]
    assert block_keys(b"hi") == []
    assert revision_key([], b"hi") == zlib.crc32(b"hi")


def run(scenario: Any) -> None:
    asyncio.run(scenario)


def test_the_edge_splits_by_weight_and_keeps_each_conversation_on_one_revision(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        engines = [FakeEngine("m") for _ in range(3)]
        for engine in engines:
            await engine.start()
        try:
            table = split_table(make_table, 25.0)
            for entry, engine in zip(table["models"]["m"]["replicas"], engines, strict=True):
                entry["url"] = engine.url
            async with running_edge(signing_key, state_dir) as edge:
                status, body = await edge.push(table, signing_key)
                assert status == 200, body
                n = 240
                served: dict[int, str] = {}
                for i in range(n):
                    response = await edge.chat("m", messages=conversation(i))
                    assert response.status == 200
                    served[i] = response.headers["x-meridian-replica"]
                    await response.read()
                expected = {i: CANARY if pick_revision(parse_table_shares(25.0),
                                                       point_of(conversation(i))) == CANARY
                            else STABLE for i in range(n)}
                got = {i: CANARY if served[i] == "canary" else STABLE for i in range(n)}
                assert got == expected
                share = 100.0 * sum(1 for r in got.values() if r == CANARY) / n
                assert 25.0 - 12 <= share <= 25.0 + 12, share
                # The same conversation again: the same revision every time.
                for i in range(0, n, 12):
                    for _ in range(3):
                        response = await edge.chat("m", messages=later_turn(i))
                        again = response.headers["x-meridian-replica"]
                        await response.read()
                        assert (again == "canary") == (got[i] == CANARY)

                # Weight 0: nothing reaches the canary, whatever the conversation.
                table["version"] = 2
                table["models"]["m"]["revisions"] = {STABLE: 100.0, CANARY: 0.0}
                status, body = await edge.push(table, signing_key)
                assert status == 200, body
                before = len(engines[2].requests)
                for i in range(n):
                    response = await edge.chat("m", messages=conversation(i))
                    assert response.headers["x-meridian-replica"] != "canary"
                    await response.read()
                assert len(engines[2].requests) == before
        finally:
            for engine in engines:
                await engine.stop()

    run(scenario())


def test_a_revision_without_a_usable_replica_hands_its_share_to_the_others(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        engine = FakeEngine("m")
        await engine.start()
        try:
            table = make_table(models={"m": [replica("stable", engine.url, revision=STABLE)]})
            # The canary is listed with a share but has no replica on this edge yet.
            table["models"]["m"]["revisions"] = {STABLE: 50.0, CANARY: 50.0}
            async with running_edge(signing_key, state_dir) as edge:
                status, body = await edge.push(table, signing_key)
                assert status == 200, body
                for i in range(20):
                    response = await edge.chat("m", messages=conversation(i))
                    assert response.status == 200
                    assert response.headers["x-meridian-replica"] == "stable"
                    await response.read()
        finally:
            await engine.stop()

    run(scenario())




def test_the_edge_counts_requests_ttft_and_itl_by_the_answering_revision(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    """A failing canary's 5xx (its own, then the edge's once it is ejected) are counted
    against its revision, though its clients are answered by the stable revision (the
    failure came before the first byte: retried there); the stable revision's answers and
    stream gaps are counted against its own; an unsplit model gets no revision series."""
    async def scenario() -> None:
        engines = [FakeEngine("m") for _ in range(3)]
        engines[2].behaviour.status = 500  # the canary fails everything
        for engine in engines[:2]:
            engine.behaviour.event_gap_s = 0.002  # events in reads of their own
        plain = FakeEngine("plain")
        for engine in [*engines, plain]:
            await engine.start()
        try:
            table = split_table(make_table, 50.0)
            for entry, engine in zip(table["models"]["m"]["replicas"], engines, strict=True):
                entry["url"] = engine.url
            table["models"]["plain"] = {"replicas": [replica("p", plain.url)]}
            async with running_edge(signing_key, state_dir) as edge:
                status, body = await edge.push(table, signing_key)
                assert status == 200, body
                got: Counter[tuple[str, int]] = Counter()
                for i in range(60):
                    response = await edge.chat("m", messages=conversation(i), stream=True)
                    served = response.headers.get("x-meridian-replica", "")
                    await response.read()
                    on_canary = pick_revision(parse_table_shares(50.0),
                                              point_of(conversation(i))) == CANARY
                    assert response.status == 200 and served in ("stable-a", "stable-b")
                    got[(CANARY if on_canary else STABLE, response.status)] += 1
                response = await edge.chat("plain")
                await response.read()
                async with edge.session.get(edge.admin_url + "/metrics") as answer:
                    text = await answer.text()
                rows = (await edge.admin("GET", "/admin/replicas"))[1]["replicas"]
        finally:
            for engine in [*engines, plain]:
                await engine.stop()
        canary_tried = len(engines[2].requests)
        assert got[(CANARY, 200)] > 0 and got[(STABLE, 200)] > 0 and canary_tried > 0
        lines = dict(line.rsplit(" ", 1) for line in text.splitlines()
                     if line.startswith("meridian_edge_revision_"))

        def requests(revision: str, status: int) -> float:
            return float(lines.get('meridian_edge_revision_requests_total{model="m",revision="'
                                   f'{revision}",status="{status}"}}', 0))

        # The canary's own 500s until it was ejected, the edge's 503s after: one failed
        # attempt for each of its conversations' requests; every request once more by the
        # stable replica that answered it.
        assert requests(CANARY, 500) == canary_tried
        assert requests(CANARY, 500) + requests(CANARY, 503) == got[(CANARY, 200)]
        assert requests(CANARY, 200) == 0
        assert requests(STABLE, 200) == sum(got.values())
        # TTFT for every answer sent, all the stable revision's; inter-token gaps likewise.
        assert float(lines['meridian_edge_revision_time_to_first_token_seconds_count'
                           f'{{model="m",revision="{STABLE}"}}']) == sum(got.values())
        assert float(lines.get('meridian_edge_revision_time_to_first_token_seconds_count'
                               f'{{model="m",revision="{CANARY}"}}', 0)) == 0
        assert float(lines['meridian_edge_revision_inter_token_latency_seconds_count'
                           f'{{model="m",revision="{STABLE}"}}']) > sum(got.values())
        assert not any('model="plain"' in key for key in lines)
        # The edge's replica list says which revision each replica runs.
        expected = {"stable-a": STABLE, "stable-b": STABLE, "canary": CANARY, "p": None}
        assert {row["id"]: row["revision"] for row in rows} == {
            row["id"]: expected[row["id"]] for row in rows}
        assert {"canary", "p"} <= {row["id"] for row in rows}

    run(scenario())
