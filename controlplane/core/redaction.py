"""What tenant users see of platform data: no replica or edge addresses, no tracebacks.

Replica URLs would let a tenant reach an engine past the edges (unmetered, past its rate
limits, budget and residency); an edge's admin address is the door its tables come through;
an operation's log holds provider output and tracebacks that name hosts, paths and other
tenants' replicas. Platform staff see all of it; the REST API and the dashboard show tenant
users these redacted forms instead.
"""

from __future__ import annotations

import re

HIDDEN = "[address hidden]"
# URLs of any scheme, then bare IPv4 (with an optional port) and bracketed IPv6 addresses.
_ADDRESSES = re.compile(
    r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>]+"
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?\b"
    r"|\[[0-9a-fA-F:]+\](?::\d{1,5})?",
    re.IGNORECASE)


def redact_addresses(text: str) -> str:
    """`text` with every URL and IP address replaced by HIDDEN."""
    return _ADDRESSES.sub(HIDDEN, text) if text else text


def operation_summary(kind: str, status: str, error_kind: str, attempts: int) -> str:
    """One line for a tenant user in place of an operation's log: what it was and how it
    went, never the provider's output."""
    words = f"{kind} {status}"
    if attempts > 1:
        words += f" after {attempts} attempts"
    if error_kind:
        words += f" ({error_kind})"
    return words + "; the full log is for platform staff."
