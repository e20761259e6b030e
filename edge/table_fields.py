"""Reading each part of a routing table: replicas, revisions, tenants, policy, aliases.

Each reader checks its part's shape and values and raises `TableError` naming the field;
`edge.table.parse_table` puts the parts together.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from edge.cache_salt import SALT_MAX_CHARS, SALT_MIN_CHARS, fallback_salt, valid_tenant_salt
from edge.table_types import (
    KNOWN_PICKERS,
    KNOWN_SCORERS,
    KNOWN_STATES,
    MAX_RESUMPTIONS,
    STALE_MODES,
    TIERS,
    Alias,
    AliasRule,
    Policy,
    Replica,
    TableError,
    TenantRules,
    parse_origin,
)

_REQUIRED: Any = object()
_KINDS: dict[str, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "number": (int, float), "object": (dict,),
}


def get_field(obj: Mapping[str, Any], key: str, kind: str, where: str,
              default: Any = _REQUIRED) -> Any:
    """obj[key] checked against `kind`; a missing or null optional key gives `default`."""
    value = obj.get(key)
    if value is None:
        if default is _REQUIRED:
            raise TableError(f"{where}.{key} is required", f"{where}.{key}")
        return default
    if isinstance(value, bool) or not isinstance(value, _KINDS[kind]):
        raise TableError(f"{where}.{key} must be {'an' if kind[0] in 'io' else 'a'} {kind}",
                         f"{where}.{key}")
    return float(value) if kind == "number" else value  # type: ignore[arg-type]


def _flag(obj: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TableError(f"{where}.{key} must be true or false, not {value!r}", f"{where}.{key}")
    return value


def _strings(value: Any, where: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TableError(f"{where} must be a list of strings", where)
    return frozenset(value)


def parse_replica(model: str, i: int, entry: Any) -> Replica:
    where = f"models.{model}.replicas[{i}]"
    if not isinstance(entry, dict):
        raise TableError(f"{where} must be an object", where)
    url = get_field(entry, "url", "str", where)
    state = get_field(entry, "state", "str", where, "ready")
    if state not in KNOWN_STATES:
        raise TableError(f"{where}.state must be one of {sorted(KNOWN_STATES)}", f"{where}.state")
    tier = get_field(entry, "tier", "str", where, "interactive")
    if tier not in TIERS:
        raise TableError(f"{where}.tier must be one of {list(TIERS)}", f"{where}.tier")
    max_inflight = get_field(entry, "max_inflight", "int", where, 64)
    if max_inflight < 1:
        raise TableError(f"{where}.max_inflight must be at least 1", f"{where}.max_inflight")
    weight = get_field(entry, "weight", "number", where, 1.0)
    if weight < 0:
        raise TableError(f"{where}.weight must be ≥ 0", f"{where}.weight")
    return Replica(
        id=get_field(entry, "id", "str", where),
        model=model,
        url=url,
        origin=parse_origin(url, f"{where}.url", get_field(entry, "tls_name", "str", where, None)),
        region=get_field(entry, "region", "str", where),
        jurisdiction=get_field(entry, "jurisdiction", "str", where),
        weight=weight,
        rtt_ms=max(0.0, get_field(entry, "rtt_ms", "number", where, 0.0)),
        usd_per_mtok=get_field(entry, "usd_per_mtok", "number", where, None),
        max_inflight=max_inflight,
        state=state,
        tier=tier,
        tenant=get_field(entry, "tenant", "str", where, None),
        revision=get_field(entry, "revision", "str", where, None),
        engine_authorization=_engine_authorization(entry, where),
        shared_prefix_cache=_flag(entry, "shared_prefix_cache", where, False),
    )


def revision_order(revision: str) -> tuple[int, str]:
    """Sort key for revision ids, numeric ones by value."""
    return (len(revision), revision) if revision.isdigit() else (1 << 30, revision)


def parse_revisions(model: str, entry: Any, replicas: tuple[Replica, ...]
               ) -> tuple[tuple[str, float], ...]:
    where = f"models.{model}.revisions"
    if not isinstance(entry, dict) or not entry:
        raise TableError(f"{where} must be a non-empty object of revision shares", where)
    shares: list[tuple[str, float]] = []
    for revision, share in entry.items():
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not (
                0 <= share <= 100):
            raise TableError(f"{where}.{revision} must be a share within [0, 100], not "
                             f"{share!r}", f"{where}.{revision}")
        shares.append((revision, float(share)))
    if not sum(share for _, share in shares) > 0:
        raise TableError(f"{where}: at least one revision needs a share > 0", where)
    for i, replica in enumerate(replicas):
        if replica.revision is None or replica.revision not in entry:
            raise TableError(f"models.{model}.replicas[{i}].revision must name one of "
                             f"{sorted(entry)}, not {replica.revision!r}",
                             f"models.{model}.replicas[{i}].revision")
    shares.sort(key=lambda pair: revision_order(pair[0]), reverse=True)
    return tuple(shares)


def parse_tenant(key_hash: str, entry: Any) -> TenantRules:
    where = f"tenants.{key_hash[:12]}"
    if not isinstance(entry, dict):
        raise TableError(f"{where} must be an object", where)
    tier = get_field(entry, "tier", "str", where, "interactive")
    if tier not in TIERS:
        raise TableError(f"{where}.tier must be one of {list(TIERS)}", f"{where}.tier")
    rpm = get_field(entry, "rpm", "int", where, 0)
    tpm = get_field(entry, "tpm", "int", where, 0)
    if rpm < 0 or tpm < 0:
        raise TableError(f"{where}: rpm and tpm must be ≥ 0 (0 means unlimited)", where)
    return TenantRules(
        tenant=get_field(entry, "tenant", "str", where),
        jurisdictions=_strings(entry.get("jurisdictions"), f"{where}.jurisdictions"),
        regions=_strings(entry.get("regions", []), f"{where}.regions"),
        rpm=rpm,
        tpm=tpm,
        models=_strings(entry.get("models", ["*"]), f"{where}.models"),
        tier=tier,
        resume_streams=_flag(entry, "resume_streams", where, True),
        fail_open=_flag(entry, "fail_open", where, False),
        cache_salt=_cache_salt(entry, where),
    )


def _cache_salt(entry: Mapping[str, Any], where: str) -> str:
    salt = get_field(entry, "cache_salt", "str", where, None)
    if salt is None:
        return fallback_salt(get_field(entry, "tenant", "str", where))
    if not valid_tenant_salt(salt):
        raise TableError(f"{where}.cache_salt must be {SALT_MIN_CHARS} to {SALT_MAX_CHARS} "
                         "base64url characters", f"{where}.cache_salt")
    return salt


# The policy's plain fields, each read by `get_field` with its kind (scorers and picker have
# checks of their own), in the order a table's errors are reported.
POLICY_FIELDS = (
    ("retry_before_first_byte", "int"), ("eject_after_failures", "int"),
    ("eject_base_s", "number"), ("eject_max_s", "number"), ("queue_timeout_s", "number"),
    ("batch_queue_timeout_s", "number"), ("batch_max_share", "number"),
    ("resume_streams_max", "int"), ("resume_deadline_s", "number"),
    ("stream_stall_s", "number"), ("first_byte_timeout_s", "number"),
    ("max_table_age_s", "number"), ("stale_table_mode", "str"),
)


def parse_policy(entry: Any) -> Policy:
    if entry is None:
        return Policy()
    if not isinstance(entry, dict):
        raise TableError("policy must be an object", "policy")
    defaults = Policy()
    scorers = entry.get("scorers", defaults.scorers)
    if not isinstance(scorers, dict):
        raise TableError("policy.scorers must be an object", "policy.scorers")
    for name, weight in scorers.items():
        if name not in KNOWN_SCORERS:
            raise TableError(f"unknown scorer {name!r}; known: {', '.join(KNOWN_SCORERS)}",
                             f"policy.scorers.{name}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            raise TableError(f"policy.scorers.{name} must be a number ≥ 0",
                             f"policy.scorers.{name}")
    picker = get_field(entry, "picker", "str", "policy", defaults.picker)
    if picker not in KNOWN_PICKERS:
        raise TableError(f"policy.picker must be one of {list(KNOWN_PICKERS)}", "policy.picker")
    policy = Policy(
        scorers={name: float(weight) for name, weight in scorers.items()},
        picker=picker,
        **{name: get_field(entry, name, kind, "policy", getattr(defaults, name))
           for name, kind in POLICY_FIELDS},
    )
    check_policy(policy)
    return policy


def check_policy(policy: Policy) -> None:
    """The policy's values, each within its range; raises `TableError` naming the first
    that is not."""
    if policy.retry_before_first_byte < 0 or policy.eject_after_failures < 1:
        raise TableError("policy: retries must be ≥ 0 and eject_after_failures ≥ 1", "policy")
    if policy.eject_base_s <= 0 or policy.eject_max_s < policy.eject_base_s:
        raise TableError("policy: need 0 < eject_base_s ≤ eject_max_s", "policy.eject_base_s")
    if not 0 <= policy.batch_max_share <= 1:
        raise TableError("policy.batch_max_share must be within [0, 1]", "policy.batch_max_share")
    if not 0 <= policy.resume_streams_max <= MAX_RESUMPTIONS:
        raise TableError(f"policy.resume_streams_max must be within [0, {MAX_RESUMPTIONS}] "
                         f"(0 turns resumption off), not {policy.resume_streams_max}",
                         "policy.resume_streams_max")
    if not policy.resume_deadline_s > 0:
        raise TableError(f"policy.resume_deadline_s must be > 0 seconds, not "
                         f"{policy.resume_deadline_s}", "policy.resume_deadline_s")
    if not policy.stream_stall_s > 0:
        raise TableError(f"policy.stream_stall_s must be > 0 seconds, not "
                         f"{policy.stream_stall_s}", "policy.stream_stall_s")
    if not policy.first_byte_timeout_s > 0:
        raise TableError(f"policy.first_byte_timeout_s must be > 0 seconds, not "
                         f"{policy.first_byte_timeout_s}", "policy.first_byte_timeout_s")
    if not policy.max_table_age_s > 0:
        raise TableError(f"policy.max_table_age_s must be > 0 seconds, not "
                         f"{policy.max_table_age_s}", "policy.max_table_age_s")
    if policy.stale_table_mode not in STALE_MODES:
        raise TableError(f"policy.stale_table_mode must be one of {list(STALE_MODES)}, not "
                         f"{policy.stale_table_mode!r}", "policy.stale_table_mode")


def parse_issued_at(value: Any) -> float:
    """`issued_at` (ISO 8601 with a UTC offset) as seconds since the epoch; 0.0 when absent."""
    if value is None or value == "":
        return 0.0
    if not isinstance(value, str):
        raise TableError("table.issued_at must be an ISO 8601 time", "issued_at")
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise TableError(f"table.issued_at must be an ISO 8601 time, not {value!r}",
                         "issued_at") from None
    if when.tzinfo is None:
        raise TableError(f"table.issued_at must carry a UTC offset, not {value!r}",
                         "issued_at")
    return when.timestamp()


def parse_revoked_keys(value: Any) -> frozenset[str]:
    """`revoked_keys`: sha256 hex digests of API keys."""
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(
            isinstance(v, str) and len(v) == 64 for v in value):
        raise TableError("revoked_keys must be a list of sha256 hex digests", "revoked_keys")
    return frozenset(value)


def parse_revoked_certificates(value: Any) -> frozenset[str]:
    """`revoked_certificates`: certificate serials, lower-case hex."""
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(
            isinstance(v, str) and 0 < len(v) <= 40
            and all(c in "0123456789abcdef" for c in v) for v in value):
        raise TableError("revoked_certificates must be a list of certificate serials "
                         "(lower-case hex)", "revoked_certificates")
    return frozenset(value)


def _engine_authorization(entry: Mapping[str, Any], where: str) -> bytes:
    key = get_field(entry, "engine_key", "str", where, "")
    if not key:
        return b""
    if not all(33 <= ord(c) < 127 for c in key) or len(key) > 256:
        raise TableError(f"{where}.engine_key must be 1-256 printable ASCII characters, no "
                         "spaces", f"{where}.engine_key")
    return b"authorization: Bearer %s\r\n" % key.encode()


def _alias(name: str, entry: Any) -> Alias:
    where = f"aliases.{name}"
    if isinstance(entry, str):
        if not entry:
            raise TableError(f"{where} must name a model", where)
        return Alias(name, (), entry)
    if not isinstance(entry, dict):
        raise TableError(f"{where} must be a model name or an object with rules", where)
    rules = entry.get("rules", [])
    if not isinstance(rules, list):
        raise TableError(f"{where}.rules must be a list", f"{where}.rules")
    parsed = []
    for i, rule in enumerate(rules):
        rwhere = f"{where}.rules[{i}]"
        if not isinstance(rule, dict):
            raise TableError(f"{rwhere} must be an object", rwhere)
        unknown = set(rule) - {"model", "max_prompt_tokens", "min_prompt_tokens", "tier"}
        if unknown:
            raise TableError(f"{rwhere} has unknown condition(s) {sorted(unknown)}", rwhere)
        parsed_rule = AliasRule(
            model=get_field(rule, "model", "str", rwhere),
            max_prompt_tokens=get_field(rule, "max_prompt_tokens", "int", rwhere, None),
            min_prompt_tokens=get_field(rule, "min_prompt_tokens", "int", rwhere, None),
            tier=get_field(rule, "tier", "str", rwhere, None),
        )
        if not parsed_rule.model:
            raise TableError(f"{rwhere}.model must name a model", f"{rwhere}.model")
        for bound in (parsed_rule.max_prompt_tokens, parsed_rule.min_prompt_tokens):
            if bound is not None and bound < 0:
                raise TableError(f"{rwhere}: prompt token bounds must be ≥ 0", rwhere)
        if parsed_rule.tier is not None and parsed_rule.tier not in TIERS:
            raise TableError(f"{rwhere}.tier must be one of {list(TIERS)}", f"{rwhere}.tier")
        parsed.append(parsed_rule)
    unknown = set(entry) - {"rules", "default"}
    if unknown:
        raise TableError(f"{where} has unknown key(s) {sorted(unknown)}", where)
    default = get_field(entry, "default", "str", where)
    if not default:
        raise TableError(f"{where}.default must name a model", f"{where}.default")
    return Alias(name, tuple(parsed), default)


def parse_batch_pool(model: str, pool: Any) -> frozenset[str]:
    if not isinstance(pool, list) or not pool or not all(
            isinstance(name, str) and name for name in pool):
        raise TableError(f"models.{model}.batch_pool must be a non-empty list of tenant names "
                         "or [\"*\"]", f"models.{model}.batch_pool")
    return frozenset(pool)


def parse_aliases(document: Any) -> dict[str, Alias]:
    """The `aliases` object, by the rules the edge applies (the control plane checks what it
    saves with this too)."""
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise TableError("aliases must be an object of alias → model or rules", "aliases")
    aliases = {}
    for name, entry in document.items():
        if not isinstance(name, str) or not name or len(name) > 200:
            raise TableError(f"alias name {name!r} must be 1 to 200 characters", "aliases")
        aliases[name] = _alias(name, entry)
    return aliases
