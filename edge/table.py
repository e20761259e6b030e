"""Routing tables: canonical bytes, Ed25519 signatures, parsing, and last-known-good on disk.

A table is the JSON object of DESIGN §4. Its canonical form is the compact JSON encoding
with sorted keys (`canonical_bytes`); the signature is Ed25519 over the canonical bytes of
everything but `signature`. The control plane imports `canonical_bytes` and `sign_table`
from here so that both sides agree by construction; nothing in this module has side
effects at import.

Beyond the design's shape the edge reads these optional fields (defaults in brackets):

- replica: `tier` ["interactive"], `tenant` (a replica dedicated to one tenant) [none],
  `weight` [1.0], `rtt_ms` [0], `usd_per_mtok` [null], `max_inflight` [64], `state`
  ["ready"], `revision` (the deployment revision it runs) [none], `shared_prefix_cache`
  (its deployment lets tenants share its prefix cache: requests to it get no tenant
  `cache_salt`, `edge.cache_salt`) [false].
- model: `revisions` (`{"<revision id>": share}`, shares ≥ 0 with a positive total, read
  as percentages of the model's new conversations) [none: every replica takes traffic as
  before]. With it, every replica of the model names a listed `revision`; the edge sends a
  conversation to one revision by its prefix key (`edge.policy.pick_revision`).
  `batch_pool` (the tenants, or `["*"]`, whose batch-tier requests for the model go to its
  batch-tier replicas alone, also while it has none: `edge.policy.in_batch_pool`) [none:
  batch requests may use interactive replicas too].
- tenant: `regions` (narrows `jurisdictions` to these `cloud:region` keys) [[]],
  `models` [["*"]], `tier` ["interactive"], `resume_streams` (may a stream cut mid-way
  be resumed on another replica) [true], `cache_salt` (the tenant's prefix-cache salt:
  base64url, 16 to 128 characters) [one derived from the tenant's name].
- policy: `picker` ("max_score" | "round_robin" | "random") ["max_score"],
  `eject_max_s` [60], `queue_timeout_s` [2], `batch_queue_timeout_s` [30],
  `batch_max_share` (share of an interactive replica's `max_inflight` that batch requests
  may take) [0.5], `resume_streams_max` (resumptions per stream, 0 to 10; 0 turns
  resumption off) [2], `resume_deadline_s` (resumptions start within this many seconds of
  a stream's first cut) [30], `stream_stall_s` (a stream with no byte from its replica for
  this long counts as cut) [10], `first_byte_timeout_s` (a request whose replica has sent
  nothing of its answer this long after it was sent goes to another replica:
  `edge.first_byte`) [30], `max_table_age_s` (a table issued longer ago than this is stale)
  [86400], `stale_table_mode` (what a stale table means: "last_known_good" keeps serving it,
  "fail_closed" refuses every tenant but those marked `fail_open`) ["last_known_good"].
- tenant: `fail_open` (served from a stale table also under "fail_closed") [false].
- top-level `issued_at`: ISO 8601 with a UTC offset; a table without it counts as stale.
- top-level `revoked_keys`: sha256 hashes of keys revoked lately; the edge refuses them for
  good, whatever table it serves afterwards (`edge.revocations`) [[]].
- top-level `revoked_certificates`: serials (lower-case hex) of engine-CA certificates
  revoked and not yet expired; the edge neither presents nor accepts them
  (`edge.upstream_tls`) [[]].
- replica: `engine_key` (the replica's own engine API key, sent as its bearer token) [none],
  `tls_name` (the name its server certificate carries, checked instead of the URL's host)
  [the host].
- top-level `aliases`: `{"auto": {"rules": [{"max_prompt_tokens": 1000, "model": "small"}],
  "default": "large"}}`, or a plain `{"gpt-4o": "large"}`. Rules are tried in order; a rule
  may hold `max_prompt_tokens`, `min_prompt_tokens` and `tier`, and matches when all hold.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from edge.keys import public_key_id
from edge.table_fields import (
    get_field,
    parse_aliases,
    parse_batch_pool,
    parse_issued_at,
    parse_policy,
    parse_replica,
    parse_revisions,
    parse_revoked_certificates,
    parse_revoked_keys,
    parse_tenant,
)
from edge.table_types import ROUTABLE_STATES as ROUTABLE_STATES
from edge.table_types import Origin as Origin
from edge.table_types import Policy as Policy
from edge.table_types import (
    Replica,
    RoutingTable,
    SignatureError,
    TableError,
    TenantRules,
)
from edge.table_types import parse_origin as parse_origin

TABLE_FILE = "table.json"


def canonical_bytes(table: Mapping[str, Any]) -> bytes:
    """Compact JSON with sorted keys, UTF-8: the one encoding both sides hash and sign.

    It encodes exactly what it is given; `signing_bytes` drops `signature` first.
    """
    return json.dumps(
        table, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def signing_bytes(table: Mapping[str, Any]) -> bytes:
    """The bytes the signature covers: the canonical form of everything but `signature`."""
    return canonical_bytes({k: v for k, v in table.items() if k != "signature"})


def table_hash(table: Mapping[str, Any]) -> str:
    """sha256 of the canonical form of the whole signed table (the pull API's ETag)."""
    return hashlib.sha256(canonical_bytes(table)).hexdigest()


def sign_table(table: Mapping[str, Any], private_key: Ed25519PrivateKey) -> dict[str, Any]:
    """A copy of `table` with `signature` set (base64 Ed25519 over `signing_bytes`)."""
    unsigned = {k: v for k, v in table.items() if k != "signature"}
    signature = private_key.sign(signing_bytes(unsigned))
    return {**unsigned, "signature": base64.b64encode(signature).decode()}


def verify_table(table: Mapping[str, Any],
                 public_keys: Ed25519PublicKey | Iterable[Ed25519PublicKey]) -> None:
    """Raise SignatureError unless one of `public_keys` signed `table`."""
    keys = [public_keys] if isinstance(public_keys, Ed25519PublicKey) else list(public_keys)
    signature = table.get("signature")
    if not isinstance(signature, str) or not signature:
        raise SignatureError("the table is not signed", "signature")
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError("the signature is not base64", "signature") from None
    if len(raw) != 64:
        raise SignatureError("the signature is not 64 bytes of Ed25519", "signature")
    payload = signing_bytes(table)
    # Try the key the table names first, so a rotation with two keys costs one check.
    key_id = table.get("key_id")
    keys.sort(key=lambda k: public_key_id(k) != key_id)
    for key in keys:
        try:
            key.verify(raw, payload)
            return
        except InvalidSignature:
            continue
    raise SignatureError("the signature does not match the table under any trusted key",
                         "signature")


def parse_table(document: Mapping[str, Any]) -> RoutingTable:
    """Check the shape of a (verified) table and build what the hot path reads."""
    if not isinstance(document, Mapping):
        raise TableError("a table must be a JSON object")
    version = get_field(document, "version", "int", "table")
    if version < 0:
        raise TableError("table.version must be ≥ 0", "version")
    models_doc = get_field(document, "models", "object", "table", {})
    models: dict[str, tuple[Replica, ...]] = {}
    revisions: dict[str, tuple[tuple[str, float], ...]] = {}
    batch_pools: dict[str, frozenset[str]] = {}
    for model, entry in models_doc.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("replicas", []), list):
            raise TableError(f"models.{model} must be {{\"replicas\": [...]}}", f"models.{model}")
        replicas = tuple(parse_replica(model, i, r)
                         for i, r in enumerate(entry.get("replicas", [])))
        ids = [r.id for r in replicas]
        if len(set(ids)) != len(ids):
            raise TableError(f"models.{model} lists a replica id twice", f"models.{model}")
        models[model] = replicas
        if entry.get("revisions") is not None:
            revisions[model] = parse_revisions(model, entry["revisions"], replicas)
        if entry.get("batch_pool") is not None:
            batch_pools[model] = parse_batch_pool(model, entry["batch_pool"])
    tenants_doc = get_field(document, "tenants", "object", "table", {})
    tenants = {key_hash: parse_tenant(key_hash, entry) for key_hash, entry in tenants_doc.items()}
    aliases = parse_aliases(get_field(document, "aliases", "object", "table", {}))
    for name in aliases:
        if name in models:
            raise TableError(f"alias {name!r} shadows a model of the same name", f"aliases.{name}")
    return RoutingTable(
        version=version,
        edge=get_field(document, "edge", "str", "table", ""),
        issued_at=get_field(document, "issued_at", "str", "table", ""),
        key_id=get_field(document, "key_id", "str", "table", ""),
        hash=table_hash(document),
        models=models,
        tenants=tenants,
        policy=parse_policy(document.get("policy")),
        aliases=aliases,
        document=document,
        revisions=revisions,
        batch_pools=batch_pools,
        issued_at_s=parse_issued_at(document.get("issued_at")),
        revoked_keys=parse_revoked_keys(document.get("revoked_keys")),
        revoked_certificates=parse_revoked_certificates(document.get("revoked_certificates")),
    )


def verified_document(body: bytes, public_keys: Iterable[Ed25519PublicKey]) -> dict[str, Any]:
    """Parse JSON bytes and verify the signature; the shape is not checked yet."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TableError(f"the table is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise TableError("a table must be a JSON object")
    verify_table(document, public_keys)
    return document


def load_verified(body: bytes, public_keys: Iterable[Ed25519PublicKey]) -> RoutingTable:
    """Parse JSON bytes, verify the signature, then check the shape."""
    return parse_table(verified_document(body, public_keys))


def save_last_known_good(state_dir: str | Path, table: RoutingTable) -> Path:
    """Write the table to `state_dir/table.json` so that a crash leaves the old or the new one.

    Temp file in the same directory, fsync, rename over, fsync the directory.
    """
    directory = Path(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / TABLE_FILE
    fd, temp = tempfile.mkstemp(prefix=".table-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(canonical_bytes(table.document))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def load_last_known_good(
    state_dir: str | Path, public_keys: Iterable[Ed25519PublicKey]
) -> RoutingTable | None:
    """The table saved in `state_dir`, verified again (the disk is not trusted), or None."""
    path = Path(state_dir) / TABLE_FILE
    try:
        body = path.read_bytes()
    except FileNotFoundError:
        return None
    return load_verified(body, list(public_keys))


def with_tenants(table: RoutingTable, tenants: Mapping[str, TenantRules]) -> RoutingTable:
    """The same table serving only `tenants` (keys revoked since it was signed are left out)."""
    return RoutingTable(
        version=table.version, edge=table.edge, issued_at=table.issued_at,
        key_id=table.key_id, hash=table.hash, models=table.models, tenants=tenants,
        policy=table.policy, aliases=table.aliases, document=table.document,
        revisions=table.revisions, batch_pools=table.batch_pools,
        issued_at_s=table.issued_at_s, revoked_keys=table.revoked_keys,
        revoked_certificates=table.revoked_certificates,
    )
