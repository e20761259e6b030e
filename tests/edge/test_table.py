"""Routing tables: canonical bytes, signatures, shape checks, keys, and the table on disk."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge.keys import (
    KeyFormatError,
    load_private_key,
    load_public_key,
    private_key_pem,
    public_key_id,
    public_key_pem,
)
from edge.table import (
    TABLE_FILE,
    SignatureError,
    TableError,
    canonical_bytes,
    load_last_known_good,
    load_verified,
    parse_table,
    save_last_known_good,
    sign_table,
    signing_bytes,
    table_hash,
    verify_table,
)

from .conftest import TableFactory, replica, tenant


def test_canonical_bytes_sort_keys_and_drop_whitespace() -> None:
    assert canonical_bytes({"b": [1, {"d": 2, "c": "é"}], "a": 1.5}) == (
        '{"a":1.5,"b":[1,{"c":"é","d":2}]}'.encode())


def test_signature_covers_everything_but_itself(signing_key: Ed25519PrivateKey,
                                               make_table: TableFactory) -> None:
    table = make_table()
    signed = sign_table(table, signing_key)
    assert signing_bytes(signed) == canonical_bytes(table)
    verify_table(signed, signing_key.public_key())
    # Key order and whitespace in transit do not matter: the canonical form does.
    reparsed = json.loads(json.dumps(signed, indent=2, sort_keys=False))
    verify_table(reparsed, signing_key.public_key())


@pytest.mark.parametrize("tamper", [
    lambda t: t.__setitem__("version", t["version"] + 1),
    lambda t: t["models"]["m"]["replicas"][0].__setitem__("jurisdiction", "US"),
    lambda t: t["tenants"][next(iter(t["tenants"]))]["jurisdictions"].append("US"),
    lambda t: t.__setitem__("extra", True),
], ids=["version", "replica-jurisdiction", "tenant-jurisdictions", "added-field"])
def test_tampered_table_fails_verification(signing_key: Ed25519PrivateKey,
                                           make_table: TableFactory,
                                           tamper: Callable[[dict[str, Any]], object]) -> None:
    signed = sign_table(make_table(), signing_key)
    tamper(signed)
    with pytest.raises(SignatureError):
        verify_table(signed, signing_key.public_key())


def test_unsigned_wrongly_signed_and_garbled_signatures_are_refused(
        signing_key: Ed25519PrivateKey, make_table: TableFactory) -> None:
    table = make_table()
    with pytest.raises(SignatureError, match="not signed"):
        verify_table(table, signing_key.public_key())
    other = sign_table(table, Ed25519PrivateKey.generate())
    with pytest.raises(SignatureError, match="does not match"):
        verify_table(other, signing_key.public_key())
    with pytest.raises(SignatureError, match="base64"):
        verify_table({**table, "signature": "not base64!"}, signing_key.public_key())


def test_a_second_trusted_key_verifies_during_rotation(make_table: TableFactory) -> None:
    old, new = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    signed = sign_table({**make_table(), "key_id": public_key_id(new.public_key())}, new)
    verify_table(signed, [old.public_key(), new.public_key()])


@pytest.mark.parametrize(("change", "field"), [
    (lambda t: t.__setitem__("version", "7"), "table.version"),
    (lambda t: t["models"]["m"]["replicas"][0].__setitem__("url", "ftp://x"),
     "models.m.replicas[0].url"),
    (lambda t: t["models"]["m"]["replicas"][0].pop("jurisdiction"),
     "models.m.replicas[0].jurisdiction"),
    (lambda t: t["models"]["m"]["replicas"][0].__setitem__("max_inflight", 0),
     "models.m.replicas[0].max_inflight"),
    (lambda t: t["policy"]["scorers"].__setitem__("vibes", 1.0), "policy.scorers.vibes"),
    (lambda t: t["policy"].__setitem__("picker", "best"), "policy.picker"),
    (lambda t: t.__setitem__("aliases", {"auto": {"rules": [{"model": "m", "size": 1}],
                                                  "default": "m"}}), "aliases.auto.rules[0]"),
], ids=["version-type", "url-scheme", "missing-jurisdiction", "max-inflight", "scorer",
        "picker", "alias-rule"])
def test_bad_shapes_name_the_field(make_table: TableFactory,
                                   change: Callable[[dict[str, Any]], object], field: str) -> None:
    table = make_table()
    change(table)
    with pytest.raises(TableError) as caught:
        parse_table(table)
    assert caught.value.field == field


def test_parse_reads_defaults_and_extensions(make_table: TableFactory) -> None:
    table = make_table(
        models={"small": [replica("s1", tier="batch", tenant="acme")],
                "large": [replica("l1", "https://engine.example:8443/v")]},
        tenants={"k": tenant(regions=["aws:eu-west-1"], models=["small"])},
        aliases={"auto": {"rules": [{"max_prompt_tokens": 100, "model": "small"}],
                          "default": "large"}, "gpt-4o": "large"},
    )
    parsed = parse_table(table)
    small, large = parsed.models["small"][0], parsed.models["large"][0]
    assert (small.tier, small.tenant, small.state) == ("batch", "acme", "ready")
    assert large.origin.scheme == "https" and large.origin.port == 8443
    assert large.origin.base_path == b"/v" and large.origin.host_header == b"engine.example:8443"
    rules = next(iter(parsed.tenants.values()))
    assert rules.regions == frozenset({"aws:eu-west-1"}) and rules.models == frozenset({"small"})
    assert parsed.aliases["auto"].resolve(50, "interactive") == "small"
    assert parsed.aliases["auto"].resolve(5000, "interactive") == "large"
    assert parsed.aliases["gpt-4o"].resolve(1, "batch") == "large"
    assert parsed.hash == table_hash(table)


def test_keys_load_from_pem_and_raw_base64() -> None:
    key = Ed25519PrivateKey.generate()
    raw_private = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                    serialization.NoEncryption())
    raw_public = key.public_key().public_bytes(serialization.Encoding.Raw,
                                               serialization.PublicFormat.Raw)
    for loaded in (load_private_key(private_key_pem(key)),
                   load_private_key(base64.b64encode(raw_private).decode())):
        assert public_key_id(loaded.public_key()) == public_key_id(key.public_key())
    for public in (load_public_key(public_key_pem(key)),
                   load_public_key(base64.b64encode(raw_public))):
        assert public_key_id(public) == public_key_id(key.public_key())
    with pytest.raises(KeyFormatError):
        load_public_key("definitely not a key")
    with pytest.raises(KeyFormatError):
        load_public_key(base64.b64encode(b"short").decode())


def test_last_known_good_is_written_atomically_and_verified_on_load(
        tmp_path: Path, signing_key: Ed25519PrivateKey, make_table: TableFactory) -> None:
    first = load_verified(canonical_bytes(sign_table(make_table(version=1), signing_key)),
                          [signing_key.public_key()])
    second = load_verified(canonical_bytes(sign_table(make_table(version=2), signing_key)),
                           [signing_key.public_key()])
    save_last_known_good(tmp_path, first)
    save_last_known_good(tmp_path, second)
    # Only the table itself is left behind: no temp files.
    assert os.listdir(tmp_path) == [TABLE_FILE]
    loaded = load_last_known_good(tmp_path, [signing_key.public_key()])
    assert loaded is not None and loaded.version == 2 and loaded.hash == second.hash
    # The disk is not trusted: an edited file is refused on load.
    document = json.loads((tmp_path / TABLE_FILE).read_bytes())
    document["version"] = 99
    (tmp_path / TABLE_FILE).write_bytes(canonical_bytes(document))
    with pytest.raises(SignatureError):
        load_last_known_good(tmp_path, [signing_key.public_key()])
    assert load_last_known_good(tmp_path / "empty", [signing_key.public_key()]) is None


def test_a_failed_write_leaves_the_previous_table(tmp_path: Path, signing_key: Ed25519PrivateKey,
                                                  make_table: TableFactory,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [signing_key.public_key()]
    first = load_verified(canonical_bytes(sign_table(make_table(version=1), signing_key)), keys)
    save_last_known_good(tmp_path, first)
    second = load_verified(canonical_bytes(sign_table(make_table(version=2), signing_key)), keys)

    def crash(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        save_last_known_good(tmp_path, second)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [TABLE_FILE]
    loaded = load_last_known_good(tmp_path, keys)
    assert loaded is not None and loaded.version == 1


@pytest.mark.parametrize(("where", "key", "value", "words"), [
    ("policy", "resume_streams_max", 11, "within [0, 10]"),
    ("policy", "resume_streams_max", -1, "within [0, 10]"),
    ("policy", "resume_streams_max", "2", "must be an int"),
    ("policy", "resume_streams_max", True, "must be an int"),
    ("policy", "resume_deadline_s", 0, "must be > 0"),
    ("policy", "stream_stall_s", -1.5, "must be > 0"),
    ("policy", "stream_stall_s", "10s", "must be a number"),
    ("tenant", "resume_streams", "no", "must be true or false"),
    ("tenant", "resume_streams", 0, "must be true or false"),
])
def test_resumption_fields_are_checked(make_table: TableFactory, where: str, key: str,
                                       value: Any, words: str) -> None:
    table = make_table()
    if where == "policy":
        table["policy"][key] = value
        field = f"policy.{key}"
    else:
        entry = next(iter(table["tenants"].values()))
        entry[key] = value
        field = f"tenants.{next(iter(table['tenants']))[:12]}.{key}"
    with pytest.raises(TableError) as caught:
        parse_table(table)
    assert caught.value.field == field
    assert words in str(caught.value)


def test_resumption_fields_default_and_parse(make_table: TableFactory) -> None:
    parsed = parse_table(make_table())
    policy = parsed.policy
    assert (policy.resume_streams_max, policy.resume_deadline_s, policy.stream_stall_s) == (
        2, 30.0, 10.0)
    assert all(rules.resume_streams for rules in parsed.tenants.values())
    table = make_table(tenants={"k": tenant(resume_streams=False)})
    table["policy"].update(resume_streams_max=0, resume_deadline_s=5, stream_stall_s=0.5)
    parsed = parse_table(table)
    assert (parsed.policy.resume_streams_max, parsed.policy.resume_deadline_s,
            parsed.policy.stream_stall_s) == (0, 5.0, 0.5)
    assert not next(iter(parsed.tenants.values())).resume_streams
