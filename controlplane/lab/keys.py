"""The lab's keys, made on its first run under var/keys: the table-signing key, the key the
edges' admin secrets derive from, the engine CA and Prometheus' client certificate."""

from __future__ import annotations

import os
from pathlib import Path

from controlplane.core import certificates
from controlplane.lab.processes import say
from controlplane.routing.edge_secrets import default_key_path, generate_key_file
from controlplane.routing.signing import generate_key_files


def prepare_keys(var_dir: Path) -> Path:
    """Make what is missing and point the environment at it; returns the signing key's file."""
    key_file = var_dir / "keys" / "signing-key.pem"
    os.environ["MERIDIAN_SIGNING_KEY_FILE"] = str(key_file)
    if not key_file.exists():
        generate_key_files(key_file)
        say(f"  generated the table-signing key {key_file}")
    # Each edge's admin secret derives from this key; made now, before any process needs it.
    os.environ["MERIDIAN_EDGE_ADMIN_KEY_FILE"] = str(var_dir / "keys" / "edge-admin.key")
    generate_key_file(default_key_path())
    if not (certificates.ca_dir() / certificates.CA_KEY_FILE).exists():
        certificates.generate_ca_files(certificates.ca_dir())
        say(f"  generated the engine CA in {certificates.ca_dir()}")
    # Prometheus scrapes engines with a client certificate of its own (renewed in place).
    certificates.ensure_installed("scraper:prometheus", "client", "prometheus", [],
                                  var_dir / "prometheus" / "tls")
    return key_file
