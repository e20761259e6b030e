"""The names clients send as `model`: served names and aliases share one namespace.

An edge refuses a table in which an alias and a served name are the same (which one would it
mean?), so the API refuses both orders at the door: a deployment whose served name is an
alias, and an alias that is some deployment's served name. Aliases are checked with the
edge's own parser (`edge.table.parse_aliases`) when they are saved.
"""

from __future__ import annotations

from typing import Any

from controlplane.deployments.models import Deployment
from controlplane.routing.models import RoutingPolicy
from edge.table import TableError, parse_aliases


def alias_names() -> set[str]:
    """Every alias of every routing policy."""
    names: set[str] = set()
    for aliases in RoutingPolicy.objects.values_list("aliases", flat=True):
        if isinstance(aliases, dict):
            names.update(aliases)
    return names


def served_name_problem(served_name: str) -> str | None:
    """Why `served_name` cannot be a deployment's served name, or None."""
    if served_name in alias_names():
        return (f"{served_name!r} is a model alias of the routing policy (aliases); a served "
                "name and an alias may not be the same. Choose another served_model_name.")
    return None


def alias_problems(aliases: Any) -> str | None:
    """Why `aliases` cannot be saved — the edge's own rules, then names already served — or
    None."""
    try:
        parsed = parse_aliases(aliases)
    except TableError as error:
        return str(error)
    taken = sorted(set(Deployment.objects.filter(served_model_name__in=list(parsed))
                       .values_list("served_model_name", flat=True)))
    if taken:
        owners = sorted(Deployment.objects.filter(served_model_name__in=taken)
                        .values_list("name", flat=True))
        return (f"alias {taken[0]!r} is the served_model_name of deployment(s) "
                f"{', '.join(owners)}; an alias and a served name may not be the same.")
    return None
