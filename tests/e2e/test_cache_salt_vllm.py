"""Prefix-cache isolation on a real vLLM (CPU build, prefix caching on,
--enable-prompt-tokens-details) behind the edge: tenant B sending tenant A's exact ~900-token
prompt right after A finds nothing in the cache (`cached_tokens` 0), also when B names A's
salt as its own `cache_salt`; A's second request still hits. One engine, four requests.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge.local import build_table
from tests.edge.conftest import replica, signing_key, tenant
from tests.edge.helpers import EdgeUnderTest, running_edge
from tests.real_engine import start_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.real_engine]
__all__ = ["signing_key"]  # the edge tests' fixture, used here too

MODEL = "smollm2-135m-instruct"
KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
SALT_A, SALT_B = "Aa0-" * 11, "Bb1_" * 11  # as the control plane's: 44 base64url characters
SENTENCE = "Meridian places each replica where it is cheapest and routes requests near. "


async def ask(edge: EdgeUnderTest, key: str, system: str, **extra: Any) -> dict[str, Any]:
    async with edge.session.post(edge.url + "/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Which region is nearest?"}], **extra},
            headers={"authorization": f"Bearer {key}"},
            # A backstop: a 900-token prefill on a loaded CPU can take tens of seconds.
            timeout=aiohttp.ClientTimeout(total=180)) as response:
        body = await response.json()
        assert response.status == 200, body
        return dict(body["usage"])


@pytest.mark.timeout(900)  # a real vLLM takes 20-70 s to start, minutes on a loaded machine
def test_another_tenant_finds_nothing_of_a_prompt_in_a_shared_engines_cache(
        signing_key: Ed25519PrivateKey, tmp_path: Path) -> None:
    table = build_table(1, "edge-test", {MODEL: [replica("shared", "http://127.0.0.1:9")]},
                        {KEY_A: tenant("tenant-a", cache_salt=SALT_A),
                         KEY_B: tenant("tenant-b", cache_salt=SALT_B)})
    system = f"Session {uuid.uuid4().hex}. " + SENTENCE * 60  # some 900 tokens

    with start_vllm("--enable-prefix-caching") as engine:
        table["models"][MODEL]["replicas"][0]["url"] = engine.url

        async def scenario() -> list[dict[str, Any]]:
            async with running_edge(signing_key, tmp_path / "state") as edge:
                assert (await edge.push(table, signing_key))[0] == 200
                return [await ask(edge, KEY_A, system),
                        await ask(edge, KEY_B, system),
                        await ask(edge, KEY_B, system, cache_salt=SALT_A),
                        await ask(edge, KEY_A, system)]

        first_a, b, b_as_a, second_a = asyncio.run(scenario())

    prompt_tokens = first_a["prompt_tokens"]
    assert prompt_tokens >= 800
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in (first_a, b, b_as_a)]
    assert cached == [0, 0, 0]
    hit = second_a["prompt_tokens_details"]["cached_tokens"]
    assert prompt_tokens // 2 <= hit < prompt_tokens, (hit, prompt_tokens)
