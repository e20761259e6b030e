"""Running an edge on one machine, as a child process: for benchmarks, tests and the lab.

`LocalEdge` makes a signing key (or takes one) and an admin secret (or takes one), starts
`python -m edge` on free loopback ports with a state directory, waits until it answers, and
pushes signed tables to it the way the control plane does (canonical bytes over
`PUT /admin/table`, with the admin API's HMAC header: `admin_request`).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge import admin_auth
from edge.keys import public_key_id, public_key_pem
from edge.table import canonical_bytes, sign_table


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def admin_request(admin_url: str, path: str, secret: bytes, method: str = "GET",
                  body: bytes = b"", timeout_s: float = 10.0) -> Any:
    """One admin API call signed with `secret`; its JSON answer (raises on anything but 2xx)."""
    request = urllib.request.Request(
        admin_url.rstrip("/") + path, data=body if method != "GET" else None, method=method,
        headers={"content-type": "application/json",
                 admin_auth.HEADER: admin_auth.sign(secret, method, path, body)})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def key_hash(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def replica_entry(replica_id: str, url: str, *, region: str = "local:lab-1",
                  jurisdiction: str = "EU", **extra: Any) -> dict[str, Any]:
    entry = {"id": replica_id, "url": url, "region": region, "jurisdiction": jurisdiction,
             "weight": 1.0, "rtt_ms": 1.0, "usd_per_mtok": None, "max_inflight": 256,
             "state": "ready"}
    entry.update(extra)
    return entry


def build_table(version: int, edge: str, models: Mapping[str, Sequence[Mapping[str, Any]]],
                tenants: Mapping[str, Mapping[str, Any]], *,
                policy: Mapping[str, Any] | None = None,
                aliases: Mapping[str, Any] | None = None, key_id: str = "") -> dict[str, Any]:
    """An unsigned table in the control plane's shape; `tenants` is keyed by API key."""
    return {
        "version": version,
        "issued_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "edge": edge,
        "key_id": key_id,
        "models": {model: {"replicas": list(replicas)} for model, replicas in models.items()},
        "tenants": {key_hash(api_key): dict(rules) for api_key, rules in tenants.items()},
        "aliases": dict(aliases or {}),
        "policy": dict(policy or {"scorers": {"latency": 1.0, "load": 2.0, "prefix": 3.0,
                                              "cost": 0.5},
                                  "retry_before_first_byte": 2, "eject_after_failures": 2,
                                  "eject_base_s": 1.0}),
    }


class LocalEdge:
    def __init__(self, name: str = "edge-lab-1", region: str = "local:lab-1",
                 key: Ed25519PrivateKey | None = None, state_dir: Path | None = None,
                 access_log: str | None = None, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None,
                 preexec_fn: Callable[[], None] | None = None,
                 admin_secret: bytes | None = None) -> None:
        self.name = name
        self.admin_secret = admin_secret or secrets.token_hex(32).encode()
        # Run in the child before the edge starts: benchmarks and tests pass one that makes
        # the edge die with them (controlplane.lab.processes.die_with_parent).
        self.preexec_fn = preexec_fn
        self.region = region
        self.key = key or Ed25519PrivateKey.generate()
        self._tmp = tempfile.TemporaryDirectory(prefix="meridian-edge-")
        self.state_dir = state_dir or Path(self._tmp.name) / "state"
        self.access_log = access_log or str(Path(self._tmp.name) / "access.log")
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.port = free_port()
        self.admin_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.version = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, timeout_s: float = 15.0) -> None:
        key_file = Path(self._tmp.name) / "control-plane.pub.pem"
        key_file.write_bytes(public_key_pem(self.key))
        secret_file = Path(self._tmp.name) / "admin-secret"
        secret_file.write_bytes(self.admin_secret)
        secret_file.chmod(0o600)
        command = [
            sys.executable, "-m", "edge", "--name", self.name, "--region", self.region,
            "--listen", f"127.0.0.1:{self.port}", "--admin-listen",
            f"127.0.0.1:{self.admin_port}", "--state-dir", str(self.state_dir),
            "--public-key", str(key_file), "--admin-secret-file", str(secret_file),
            "--access-log", self.access_log,
            "--log-level", "WARNING", *self.extra_args,
        ]
        if "--upstream-cert" not in self.extra_args:
            command.append("--plain-upstream")  # fake engines over plain HTTP: tests only
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **self.env}
        self.process = subprocess.Popen(command, env=env, cwd=root, preexec_fn=self.preexec_fn)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"edge exited with {self.process.returncode}")
            try:
                self.admin("/admin/table", timeout_s=1)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.05)
        raise RuntimeError(f"edge did not answer on {self.admin_url} within {timeout_s}s")

    def push(self, table: Mapping[str, Any]) -> dict[str, Any]:
        """Sign with the next version and PUT it; raises on anything but 200."""
        self.version = max(self.version + 1, int(table.get("version", 0)))
        document = dict(table, version=self.version, key_id=public_key_id(self.key.public_key()))
        body = canonical_bytes(sign_table(document, self.key))
        return dict(self.admin("/admin/table", "PUT", body))

    def admin(self, path: str, method: str = "GET", body: bytes = b"",
              timeout_s: float = 10.0) -> Any:
        """An admin API call, signed with this edge's admin secret."""
        return admin_request(self.admin_url, path, self.admin_secret, method, body, timeout_s)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> LocalEdge:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
