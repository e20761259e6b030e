"""Keys revoked in any table this edge has seen: refused for good, whatever it serves next.

A table carries `revoked_keys`, the hashes of keys the control plane revoked lately. The edge
keeps every hash from every table whose signature it verified — installed or not (a newer
table it could not parse, one not newer than what it serves) — and takes those keys out of
whatever table it serves, so that an edge cut off from the control plane and serving an old
table (its last known good, from disk after a restart) still refuses them. The set is kept on
disk beside the table (`revoked.json`, written atomically) and bounded: past `limit` hashes
the oldest are forgotten (they left every table long ago).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from edge.table import RoutingTable, TenantRules, with_tenants

log = logging.getLogger("meridian.edge")

REVOKED_FILE = "revoked.json"
DEFAULT_LIMIT = 100_000


class Revocations:
    def __init__(self, state_dir: Path, limit: int = DEFAULT_LIMIT) -> None:
        self.path = Path(state_dir) / REVOKED_FILE
        self.limit = limit
        self.hashes: dict[str, None] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self.hashes)

    def __contains__(self, key_hash: str) -> bool:
        return key_hash in self.hashes

    def load(self) -> None:
        try:
            stored = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.error("cannot read %s (%s); revocations start empty", self.path, exc)
            return
        if isinstance(stored, list):
            self.hashes = {h: None for h in stored if isinstance(h, str)}

    def add(self, hashes: Iterable[str]) -> bool:
        """Remember `hashes`; True (and saved to disk) when any was new."""
        new = [h for h in hashes if h not in self.hashes]
        if not new:
            return False
        for key_hash in new:
            self.hashes[key_hash] = None
        while len(self.hashes) > self.limit:
            del self.hashes[next(iter(self.hashes))]
        self._save()
        return True

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=".revoked-", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(list(self.hashes), handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, self.path)
        except OSError as exc:
            log.error("cannot save revocations to %s: %s", self.path, exc)
            try:
                os.unlink(temp)
            except FileNotFoundError:
                pass

    def apply(self, table: RoutingTable) -> RoutingTable:
        """`table` less the tenants' keys revoked here (the same table when none is)."""
        if not any(key_hash in self.hashes for key_hash in table.tenants):
            return table
        kept: dict[str, TenantRules] = {
            key_hash: rules for key_hash, rules in table.tenants.items()
            if key_hash not in self.hashes}
        return with_tenants(table, kept)
