"""A batch's lines sent straight to a shared replica (no edge) carry the tenant's
prefix-cache salt as the edges would give it; a line's own salt stays behind it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client

from controlplane.routing.cache_salt import tenant_cache_salt
from controlplane.routing.models import Edge

from .conftest import drive, jsonl, line
from .test_batch_api import create, upload

pytestmark = pytest.mark.django_db


def test_lines_sent_past_the_edges_carry_their_tenants_salt(fleet: Any, tenants: Any) -> None:
    assert not Edge.objects.exists()  # the runner posts to the replica itself
    salted = line("b", "mine")
    salted["body"]["cache_salt"] = "user-7"
    for key, rows in (("acme", [line("a", "plain"), salted]), ("globex", [line("c", "g")])):
        c = Client(HTTP_AUTHORIZATION=f"Bearer {fleet[key]}")
        uploaded = upload(c, jsonl(*rows))
        batch = create(c, uploaded.json()["id"])
        assert batch.status_code == 200, batch.json()
        drive(batch.json()["id"])
    sent = {r["body"]["messages"][-1]["content"]: r["body"].get("cache_salt")
            for engine in (fleet["eu"], fleet["us"]) for r in engine.requests}
    acme, globex = (tenant_cache_salt(tenants[name].pk) for name in ("acme", "globex"))
    assert sent == {"plain": acme, "mine": acme + ".user-7", "g": globex}
    assert acme != globex
    assert json.dumps(sent).count(".user-7") == 1
