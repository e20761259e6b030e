"""Every table is parsed with the edge's own parser before it is signed; what it refuses is
left out, so that one bad entry never freezes the fleet's tables. Pure: no database.

An edge refuses a table as a whole when any part of it is wrong, so one deployment saved
with a bad value (a served name that shadows an alias, a replica URL no edge can read, rows
saved before validation existed) would stop every new table — key revocations, failover, new
replicas — from reaching every edge. `screen_table` runs `edge.table.parse_table` on the
compiled table and, while it fails, removes the entry its error names: one replica, one
model (its deployments), one alias, one tenant key, or the policy (the edge's defaults
apply). Each removal is an `Exclusion`, which routing.services stores with the table and the
`table_entry_excluded` alert rule reports; the rest of the table ships.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from edge.table import TableError, parse_table

_REPLICA = re.compile(r"\.replicas\[(\d+)\]")


@dataclass(frozen=True)
class Exclusion:
    subject: str  # what the alert is about: a deployment, an alias, a tenant's key, the policy
    kind: str  # "replica" | "model" | "alias" | "tenant_key" | "policy"
    field: str  # the field the edge's parser named
    message: str  # the parser's words
    deployments: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "deployments": list(self.deployments)}


class UnscreenableTable(ValueError):
    """The table fails where no entry can be left out (its own header): a compiler bug."""


def _entry(field: str, section: Mapping[str, Any], prefix: str) -> str | None:
    """The key of `section` that `field` (e.g. "models.llama-3.1-8b.replicas[0].url") is
    about; names may hold dots, so the longest key that fits wins."""
    if not field.startswith(prefix + "."):
        return None
    rest = field[len(prefix) + 1:]
    fits = [key for key in section
            if rest == key or rest.startswith(key + ".") or rest.startswith(key + "[")]
    return max(fits, key=len) if fits else None


def _tenant_entry(field: str, tenants: Mapping[str, Any]) -> str | None:
    # The parser names a tenant by the first 12 characters of its key's hash.
    if not field.startswith("tenants."):
        return None
    short = field[len("tenants."):].split(".", 1)[0]
    return next((key for key in tenants if key[:len(short)] == short and short), None)


def screen_table(table: Mapping[str, Any], *,
                 model_owners: Mapping[str, Sequence[str]] | None = None,
                 replica_owners: Mapping[str, str] | None = None,
                 ) -> tuple[dict[str, Any], list[Exclusion]]:
    """`table` less every entry the edge's parser refuses, and what was left out.

    `model_owners`: served name → the deployments serving it; `replica_owners`: replica id →
    its deployment; both only name the deployments in the exclusions."""
    model_owners = model_owners or {}
    replica_owners = replica_owners or {}
    document: dict[str, Any] = dict(table)
    for section in ("models", "aliases", "tenants"):
        if isinstance(document.get(section), dict):
            document[section] = dict(document[section])
    exclusions: list[Exclusion] = []
    # Each pass removes one entry, so this ends; the bound is a guard against a loop.
    for _ in range(10_000):
        try:
            parse_table(document)
            return document, exclusions
        except TableError as error:
            exclusions.append(_leave_out(document, error, model_owners, replica_owners))
    raise UnscreenableTable("too many entries refused")


def _leave_out(document: dict[str, Any], error: TableError,
               model_owners: Mapping[str, Sequence[str]],
               replica_owners: Mapping[str, str]) -> Exclusion:
    field, message = error.field or "", str(error)
    models: dict[str, Any] = document.get("models") or {}
    aliases: dict[str, Any] = document.get("aliases") or {}
    tenants: dict[str, Any] = document.get("tenants") or {}
    alias = _entry(field, aliases, "aliases")
    if alias is not None and alias in models:
        # An alias and a served name the same: the deployments' entry goes, not the alias
        # (the API refuses both orders; rows from before that rule get here).
        return _drop_model(document, alias, field, message, model_owners)
    if alias is not None:
        document["aliases"] = {k: v for k, v in aliases.items() if k != alias}
        return Exclusion(f"alias {alias}", "alias", field, message)
    model = _entry(field, models, "models")
    if model is not None:
        found = _REPLICA.match(field[len("models.") + len(model):])
        entry = models[model]
        replicas = entry.get("replicas") if isinstance(entry, dict) else None
        if found is not None and isinstance(replicas, list) and int(found.group(1)) < len(
                replicas):
            index = int(found.group(1))
            replica = replicas[index]
            replica_id = replica.get("id") if isinstance(replica, dict) else None
            owner = replica_owners.get(replica_id) if isinstance(replica_id, str) else None
            models[model] = {**entry, "replicas": replicas[:index] + replicas[index + 1:]}
            document["models"] = models
            owners = (owner,) if owner else tuple(model_owners.get(model, ()))
            return Exclusion(owner or f"model {model}", "replica", field, message, owners)
        return _drop_model(document, model, field, message, model_owners)
    tenant = _tenant_entry(field, tenants)
    if tenant is not None:
        rules = tenants[tenant]
        name = rules.get("tenant") if isinstance(rules, dict) else None
        document["tenants"] = {k: v for k, v in tenants.items() if k != tenant}
        return Exclusion(f"tenant {name or '?'} key {tenant[:12]}", "tenant_key", field,
                         message)
    if field.startswith("policy") and "policy" in document:
        del document["policy"]
        return Exclusion("routing policy", "policy", field, message)
    raise UnscreenableTable(f"{field or 'table'}: {message}")


def _drop_model(document: dict[str, Any], model: str, field: str, message: str,
                model_owners: Mapping[str, Sequence[str]]) -> Exclusion:
    document["models"] = {k: v for k, v in (document.get("models") or {}).items() if k != model}
    owners = tuple(model_owners.get(model, ()))
    subject = owners[0] if len(owners) == 1 else f"model {model}"
    return Exclusion(subject, "model", field, message, owners)
