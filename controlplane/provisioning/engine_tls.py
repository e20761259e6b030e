"""A replica's part of the data plane's mTLS: its server certificate and engine key.

`secure(spec, provider)` gives the spec the replica's own engine key (always) and, with
settings.ENGINE_TLS, a server certificate from the engine CA installed under
var/engine-tls/<replica id>/ (renewed there by core.renew_certificates; engines reload it
with `--enable-ssl-refresh`). The certificate names the replica's identity
(`r-12.replicas.meridian`, what edges check when the table says `tls_name`) and every
address the provider may serve it on. `client_context()` is the control plane's own client
certificate for readiness checks, scrapes and probes (None with ENGINE_TLS off).
"""

from __future__ import annotations

import dataclasses
import ssl
from pathlib import Path

from django.conf import settings

from controlplane.core import certificates
from controlplane.core.engine_keys import engine_key
from controlplane.provisioning.base import Provider, ReplicaSpec


def identity(replica_id: str) -> str:
    return certificates.replica_tls_name(replica_id)


def tls_dir(replica_id: str) -> Path:
    return settings.VAR_DIR / "engine-tls" / replica_id


def secure(spec: ReplicaSpec, provider: Provider) -> ReplicaSpec:
    key = engine_key(spec.replica_id)
    if not settings.ENGINE_TLS:
        return dataclasses.replace(spec, engine_key=key)
    hosts_of = getattr(provider, "engine_hosts", None)
    addresses = [identity(spec.replica_id), *(hosts_of() if hosts_of is not None else [])]
    directory = tls_dir(spec.replica_id)
    certificates.ensure_installed(f"replica:{spec.replica_id}", "server", spec.replica_id,
                                  addresses, directory)
    return dataclasses.replace(spec, engine_key=key, tls_dir=str(directory))


def client_context() -> ssl.SSLContext | None:
    return certificates.engine_client_context()
