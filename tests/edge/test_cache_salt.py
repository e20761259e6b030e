"""Prefix-cache isolation at the edge: which requests carry which `cache_salt`, what a
client's own salt becomes, what the table may say, and prefix keys kept apart by tenant."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from edge.cache_salt import (
    CLIENT_SALT_MAX_CHARS,
    combined_salt,
    fallback_salt,
    salted_body,
    valid_tenant_salt,
)
from edge.policy import candidate_set
from edge.prefix import block_keys, chat_prompt_text, tenant_seed
from edge.table import Policy, TableError, parse_table

from .conftest import TableFactory, replica, tenant
from .fake_engine import Behaviour
from .test_proxy import edge_with, engines, expect_error, run
from .test_resume import STALL, policy

__all__ = ["edge_with"]  # test_proxy's fixture, used here too

SALT_A = "A" * 43
SALT_B = "B" * 43
KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
TENANTS = {KEY_A: tenant("tenant-a", cache_salt=SALT_A),
           KEY_B: tenant("tenant-b", cache_salt=SALT_B)}
PROMPT = "You are the assistant of a company whose system prompt is secret. " * 12


async def chat(edge: Any, key: str, **extra: Any) -> tuple[int, Any]:
    body = {"model": "m", "messages": [{"role": "system", "content": PROMPT},
                                       {"role": "user", "content": "hi"}], **extra}
    response = await edge.session.post(edge.url + "/v1/chat/completions", json=body,
                                       headers={"authorization": f"Bearer {key}"})
    return response.status, await response.json()


# --- the salt itself -----------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    b'{"model":"m","prompt":"x"}',
    b'  \n{ "model" : "m", "prompt": "x" }',
    json.dumps({"model": "m", "messages": [{"role": "user", "content": "{\"a\": 1}"}]}).encode(),
])
def test_a_body_without_a_salt_gets_the_tenants_without_being_encoded_again(body: bytes) -> None:
    salted = salted_body(body, SALT_A, client_field=False)
    assert orjson.loads(salted) == {**orjson.loads(body), "cache_salt": SALT_A}
    assert salted.endswith(body.lstrip()[1:])  # the client's bytes follow the inserted field


@pytest.mark.parametrize("client, expected", [
    ("user-7", SALT_A + ".user-7"),
    (None, SALT_A),  # an explicit null is no salt of the client's
])
def test_a_clients_own_salt_stays_behind_the_tenants(client: str | None, expected: str) -> None:
    body = orjson.dumps({"model": "m", "prompt": "x", "cache_salt": client})
    salted = orjson.loads(salted_body(body, SALT_A, client_field=True))
    assert salted == {"model": "m", "prompt": "x", "cache_salt": expected}


@pytest.mark.parametrize("client_b", [
    SALT_A, "." + SALT_A, SALT_A + ".x", "x", "", None, "A" * 43 + "." + "user-7",
])
def test_no_client_salt_of_one_tenant_reaches_anothers_salt(client_b: str | None) -> None:
    """Whatever tenant B sends, its engine salt starts with B's salt, and tenant salts hold
    no separator: it never equals any salt A's requests can have."""
    b = combined_salt(SALT_B, client_b)
    for client_a in (None, "user-7", client_b, SALT_B, "x"):
        assert b != combined_salt(SALT_A, client_a)
    assert b.split(".", 1)[0] == SALT_B


def test_tenant_salts_are_base64url_of_bounded_length() -> None:
    assert valid_tenant_salt(SALT_A) and valid_tenant_salt(fallback_salt("acme"))
    assert fallback_salt("acme") != fallback_salt("acme2")
    for bad in ("short", "A" * 129, "A" * 40 + ".xy", "A" * 40 + '"xy', "A" * 40 + "é12"):
        assert not valid_tenant_salt(bad)


def test_the_table_refuses_a_malformed_tenant_salt_naming_the_field(
        make_table: TableFactory) -> None:
    for bad in ("A" * 40 + '"}', "short", 42):
        with pytest.raises(TableError) as refused:
            parse_table(make_table(tenants={KEY_A: tenant("tenant-a", cache_salt=bad)}))
        assert refused.value.field is not None and refused.value.field.endswith(".cache_salt")
    table = parse_table(make_table(tenants={KEY_A: tenant("tenant-a")}))
    (rules,) = table.tenants.values()
    assert rules.cache_salt == fallback_salt("tenant-a")  # no salt given: the edge's own


def test_replicas_of_shared_deployments_keep_tenants_caches_apart_unless_they_opt_in(
        make_table: TableFactory) -> None:
    table = parse_table(make_table(models={"m": [
        replica("shared"), replica("opted", shared_prefix_cache=True),
        replica("owned", tenant="tenant-a")]}))
    isolated = {r.id: r.cache_isolated for r in table.models["m"]}
    assert isolated == {"shared": True, "opted": False, "owned": False}
    with pytest.raises(TableError, match="shared_prefix_cache"):
        parse_table(make_table(models={"m": [replica("r", shared_prefix_cache="yes")]}))


# --- prefix keys ---------------------------------------------------------------------------

def test_prefix_keys_are_the_tenants_own_where_replicas_keep_caches_apart(
        make_table: TableFactory) -> None:
    table = parse_table(make_table(
        models={"m": [replica("shared"), replica("opted", shared_prefix_cache=True)],
                "pooled": [replica("p1", shared_prefix_cache=True),
                           replica("p2", shared_prefix_cache=True)]},
        tenants=TENANTS))
    rules = {r.tenant: r for r in table.tenants.values()}

    def seed(model: str, name: str) -> int:
        return candidate_set(table.models[model], rules[name], "interactive", Policy(),
                             model).prefix_seed

    assert seed("m", "tenant-a") == tenant_seed("tenant-a") != seed("m", "tenant-b")
    assert seed("pooled", "tenant-a") == seed("pooled", "tenant-b") == 0
    a, b = (block_keys(PROMPT, seed=tenant_seed(name)) for name in ("tenant-a", "tenant-b"))
    assert len(a) == len(b) > 10 and not set(a) & set(b)
    assert block_keys(PROMPT, seed=0) == block_keys(PROMPT)


# --- through the edge ----------------------------------------------------------------------

def test_each_tenant_reaches_a_shared_replica_with_its_own_salt(
        edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m", "m") as (one, two), edge_with(
                models={"m": [replica("one", one.url), replica("two", two.url)]},
                tenants=TENANTS) as edge:
            for key in (KEY_A, KEY_B, KEY_A):
                status, body = await chat(edge, key)
                assert status == 200, body
            status, body = await chat(edge, KEY_B, cache_salt="user-7")
            assert status == 200, body
            sent = one.requests + two.requests
            assert sorted(r["cache_salt"] for r in sent) == sorted(
                [SALT_A, SALT_B, SALT_A, SALT_B + ".user-7"])
            # The prefix index holds each tenant's keys apart: B's prompt was never
            # "seen" under A's keys, so A's replica draws B by no affinity of A's.
            index = edge.edge.prefix_index
            text = sent[0]["messages"]
            assert text  # the engines got the client's messages unchanged
            for name in ("tenant-a", "tenant-b"):
                keys = block_keys(chat_prompt_text(text) or "", seed=tenant_seed(name))
                assert index.holders(keys[0])
            assert index.holders(block_keys(chat_prompt_text(text) or "")[0]) is None
    run(scenario())


def test_owned_and_opted_in_replicas_get_no_tenant_salt(
        edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m", "o") as (opted, owned), edge_with(
                models={"m": [replica("opted", opted.url, shared_prefix_cache=True)],
                        "o": [replica("owned", owned.url, tenant="tenant-a")]},
                tenants=TENANTS) as edge:
            for key, extra in ((KEY_A, {}), (KEY_B, {"cache_salt": "mine"})):
                status, body = await chat(edge, key, **extra)
                assert status == 200, body
            status, body = await chat(edge, KEY_A, model="o")
            assert status == 200, body
            assert [r.get("cache_salt") for r in opted.requests] == [None, "mine"]
            assert "cache_salt" not in owned.requests[0]
    run(scenario())


@pytest.mark.parametrize("bad", ["", 7, ["a"], "x" * (CLIENT_SALT_MAX_CHARS + 1)])
def test_a_malformed_client_salt_is_refused_naming_it(
        edge_with: Callable[..., Any], bad: Any) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("one", engine.url)]}, tenants=TENANTS) as edge:
            response = await edge.session.post(
                edge.url + "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                      "cache_salt": bad},
                headers={"authorization": f"Bearer {KEY_A}"})
            error = await expect_error(400, "invalid_value", "cache_salt")(response)
            assert "cache_salt" in error["message"]
            assert engine.requests == []
    run(scenario())


def test_a_resumed_stream_is_salted_on_its_next_replica_too(
        edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m", "m") as (flaky, other), edge_with(
                models={"m": [replica("flaky", flaky.url, rtt_ms=1),
                              replica("other", other.url, rtt_ms=90)]},
                tenants=TENANTS, policy=policy(**STALL)) as edge:
            flaky.behaviour = Behaviour(tokens=20, cut_after_events=4)
            other.behaviour = Behaviour(tokens=20)
            response = await edge.session.post(
                edge.url + "/v1/chat/completions",
                json={"model": "m", "stream": True, "cache_salt": "user-7",
                      "messages": [{"role": "user", "content": "hello"}]},
                headers={"authorization": f"Bearer {KEY_B}"})
            assert response.status == 200
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
            assert [r["cache_salt"] for r in flaky.requests + other.requests] == [
                SALT_B + ".user-7"] * 2
            assert other.requests[0]["continue_final_message"] is True
    run(scenario())
