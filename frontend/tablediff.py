"""What changed between two routing tables of one edge, in the table's own terms. Pure.

A table (DESIGN §4) lists replicas per model, tenants by key hash, aliases and the policy.
The diff names replicas added, removed and changed (weight, state, RTT …), tenants' keys
added, removed and changed, and policy or alias settings that moved; a line diff of the
pretty-printed tables backs it up for anything else.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# These change on every compile and say nothing about routing.
VOLATILE = ("version", "issued_at", "signature")


@dataclass(frozen=True)
class FieldChange:
    name: str
    before: Any
    after: Any


@dataclass(frozen=True)
class EntryChange:
    """One replica or tenant key present in both tables whose fields differ."""

    key: str
    label: str
    fields: tuple[FieldChange, ...]


@dataclass
class TableDiff:
    replicas_added: list[dict[str, Any]] = field(default_factory=list)
    replicas_removed: list[dict[str, Any]] = field(default_factory=list)
    replicas_changed: list[EntryChange] = field(default_factory=list)
    tenants_added: list[dict[str, Any]] = field(default_factory=list)
    tenants_removed: list[dict[str, Any]] = field(default_factory=list)
    tenants_changed: list[EntryChange] = field(default_factory=list)
    settings_changed: list[FieldChange] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    @property
    def unchanged(self) -> bool:
        return not any((self.replicas_added, self.replicas_removed, self.replicas_changed,
                        self.tenants_added, self.tenants_removed, self.tenants_changed,
                        self.settings_changed))


def _replicas(table: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for model, entry in (table.get("models") or {}).items():
        for replica in entry.get("replicas", []):
            out[f"{model}/{replica.get('id')}"] = {"model": model, **replica}
    return out


def _masked(rules: Mapping[str, Any]) -> dict[str, Any]:
    """A tenant's rules with its prefix-cache salt (a secret: edge/cache_salt.py) shown as
    a short digest, enough to see that it changed."""
    salt = rules.get("cache_salt")
    if not isinstance(salt, str):
        return dict(rules)
    return {**rules, "cache_salt": "sha256:" + hashlib.sha256(salt.encode()).hexdigest()[:8]}


def _tenants(table: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    # Key hashes are secrets' digests: show a short prefix, enough to tell keys apart.
    return {digest: {"key": digest[:12] + "…", **_masked(rules)}
            for digest, rules in (table.get("tenants") or {}).items()}


def _field_changes(before: Mapping[str, Any], after: Mapping[str, Any],
                   skip: tuple[str, ...] = ()) -> tuple[FieldChange, ...]:
    names = sorted((set(before) | set(after)) - set(skip))
    return tuple(FieldChange(name, before.get(name), after.get(name))
                 for name in names if before.get(name) != after.get(name))


def _settings(table: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in (table.get("policy") or {}).items():
        if isinstance(value, Mapping):
            for inner, inner_value in value.items():
                flat[f"policy.{name}.{inner}"] = inner_value
        else:
            flat[f"policy.{name}"] = value
    for name, value in (table.get("aliases") or {}).items():
        flat[f"aliases.{name}"] = value
    flat["key_id"] = table.get("key_id")
    return flat


def _pretty(table: Mapping[str, Any]) -> list[str]:
    stable = {k: v for k, v in table.items() if k not in VOLATILE}
    if isinstance(stable.get("tenants"), Mapping):
        stable["tenants"] = {k: _masked(v) for k, v in stable["tenants"].items()}
    return json.dumps(stable, indent=1, sort_keys=True).splitlines()


def diff_tables(older: Mapping[str, Any], newer: Mapping[str, Any]) -> TableDiff:
    result = TableDiff()
    before, after = _replicas(older), _replicas(newer)
    result.replicas_added = [after[k] for k in sorted(after.keys() - before.keys())]
    result.replicas_removed = [before[k] for k in sorted(before.keys() - after.keys())]
    for key in sorted(before.keys() & after.keys()):
        changes = _field_changes(before[key], after[key])
        if changes:
            label = f"{after[key]['model']} · {after[key].get('id')}"
            result.replicas_changed.append(EntryChange(key, label, changes))
    before_t, after_t = _tenants(older), _tenants(newer)
    result.tenants_added = [after_t[k] for k in sorted(after_t.keys() - before_t.keys())]
    result.tenants_removed = [before_t[k] for k in sorted(before_t.keys() - after_t.keys())]
    for key in sorted(before_t.keys() & after_t.keys()):
        changes = _field_changes(before_t[key], after_t[key], skip=("key",))
        if changes:
            label = f"{after_t[key].get('tenant')} · {after_t[key]['key']}"
            result.tenants_changed.append(EntryChange(key[:12], label, changes))
    result.settings_changed = list(_field_changes(_settings(older), _settings(newer)))
    result.lines = list(difflib.unified_diff(
        _pretty(older), _pretty(newer), fromfile=f"v{older.get('version')}",
        tofile=f"v{newer.get('version')}", lineterm="", n=2,
    ))
    return result
