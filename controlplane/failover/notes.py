"""An incident's notes: `[at, text]` pairs in time order, written from the incident's own
record so that a note and the timeline never disagree.

- A note that marks a stage (`stage_note`) is stamped with that stage's stored timestamp,
  and the figure it gives ("+27.036 s") is `timeline`'s, formatted from the same field.
- Notes name replicas by their public ids (`r-2`), never by an address: a probe's error
  names the host and port it could not reach, which `failures` replaces with the replica's
  id (`scrub`), so that "detected r-2, r-5 failed" does not go on to name one port.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime
from urllib.parse import urlsplit

from django.utils import timezone

from controlplane.failover.models import Incident
from controlplane.failover.timeline import timeline

KEEP = 50  # notes an incident keeps, the newest


def note(incident: Incident, text: str, at: datetime | None = None) -> None:
    """Add a note at `at` (now when not given), in time order; the newest KEEP are kept."""
    stamp = at or timezone.now()
    notes = [*incident.notes, [stamp.isoformat(), text]]
    notes.sort(key=lambda pair: datetime.fromisoformat(pair[0]))  # stable: ties keep order
    incident.notes = notes[-KEEP:]


def stage_note(incident: Incident, stage: str, text: str) -> None:
    """A note for a stage the incident has just reached (`stage`: a timestamp field such as
    "replacement_ready_at"), at that stamp and with the timeline's figure for it."""
    at = getattr(incident, stage)
    seconds = timeline(incident)[stage.removesuffix("_at") + "_s"]
    note(incident, f"{text} at +{seconds:.3f} s", at=at)


def _addresses(url: str) -> list[str]:
    """The ways an error may spell a replica's address: host:port and ('host', port)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return []
    if not host:
        return []
    spelled = [re.escape(parts.netloc)]
    if port is not None:
        spelled += [re.escape(f"{host}:{port}"), rf"\(\s*'{re.escape(host)}'\s*,\s*{port}\s*\)",
                    rf"\bport {port}\b"]
    return spelled


def scrub(error: str, url: str, name: str) -> str:
    """`error` with every spelling of the replica's address (from `url`) replaced by its
    public id `name`. Pure."""
    for pattern in _addresses(url):
        error = re.sub(pattern, name, error)
    return error


def failures(replicas: Iterable[tuple[str, str, str]]) -> str:
    """What failed, from (public id, url, last error) triples: "r-2, r-5: <error>" where the
    errors read alike once each replica's address is its id, else each replica's own, joined
    by "; ". Pure."""
    groups: dict[str, list[str]] = {}
    for name, url, error in replicas:
        groups.setdefault(scrub(error or "no error recorded", url, "{replica}"), []).append(name)
    parts = []
    for text, names in groups.items():
        if len(names) == 1:
            parts.append(f"{names[0]}: {text.replace('{replica}', names[0])}")
        else:
            parts.append(f"{', '.join(names)}: {text.replace('{replica}', 'the replica')}")
    return "; ".join(parts)
