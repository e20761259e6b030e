"""The lab's layout, kept across a restart: how many replicas each deployment runs in each
local region.

A replica counts when its state is live and not draining (pending, provisioning, starting,
ready, degraded): a draining replica is on its way out, so a restart does not bring it back.
The lab stops its replicas when it stops (Ctrl-C) and, after a kill, when it starts again;
either way it first writes the layout it is about to stop into the audit log (action
`lab.layout`, actor `lab`), and the next start reads the latest such entry back
(`fleet.ensure_fleet`). An empty layout (everything had been terminated) restores nothing:
that start seeds the lab as a first one does.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from controlplane.core.models import AuditLog
from controlplane.core.services import record_audit
from controlplane.deployments.lifecycle import STAYING_STATES
from controlplane.deployments.models import Replica

LAYOUT_ACTION = "lab.layout"

# deployment name -> region key (`local:eu-frankfurt`) -> replicas
Layout = dict[str, dict[str, int]]


def running_layout() -> Layout:
    """The layout of the local replicas in the database now (deployments with none absent)."""
    counts = Counter(
        Replica.objects.filter(region__cloud__name="local", state__in=STAYING_STATES)
        .values_list("deployment__name", "region__cloud__name", "region__code"))
    layout: Layout = {}
    for (deployment, cloud, code), n in sorted(counts.items()):
        layout.setdefault(deployment, {})[f"{cloud}:{code}"] = n
    return layout


def record_layout(layout: Layout, reason: str) -> None:
    """Keep `layout` as the one the next start brings back."""
    record_audit("lab", LAYOUT_ACTION, object_type="lab", object_id="layout",
                 changes={"layout": layout}, reason=reason)


def last_layout() -> Layout:
    """The layout kept by the latest stop (empty when none was, or nothing was running)."""
    entry = (AuditLog.objects.filter(action=LAYOUT_ACTION, actor="lab")
             .order_by("-id").first())
    if entry is None:
        return {}
    return _parsed(entry.changes.get("layout"))


def _parsed(value: Any) -> Layout:
    if not isinstance(value, dict):
        return {}
    layout: Layout = {}
    for deployment, regions in value.items():
        if not isinstance(regions, dict):
            continue
        counts = {str(key): int(n) for key, n in regions.items()
                  if isinstance(n, int) and n > 0}
        if counts:
            layout[str(deployment)] = counts
    return layout


def describe(layout: Layout) -> str:
    """`demo-chat: 2 in local:eu-frankfurt, 1 in local:ap-tokyo; …` for the lab's output."""
    return "; ".join(
        f"{deployment}: " + ", ".join(f"{n} in {key}" for key, n in sorted(regions.items()))
        for deployment, regions in sorted(layout.items()))
