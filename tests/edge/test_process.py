"""The edge as an operator runs it: `python -m edge`, without Django, from its state dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.lab.processes import die_with_parent
from controlplane.lab.waiting import wait_until
from edge.__main__ import admin_host_port, host_port
from edge.keys import public_key_pem
from edge.local import admin_request
from edge.table import canonical_bytes, load_verified, save_last_known_good, sign_table

from .conftest import TableFactory
from .helpers import ADMIN_SECRET, free_port

ROOT = Path(__file__).resolve().parents[2]


def test_the_edge_never_imports_django() -> None:
    code = ("import sys, edge.__main__, edge.server, edge.local, edge.pull, edge.admin; "
            "sys.exit('django' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def get(url: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_python_m_edge_serves_its_last_known_good_table_and_stops_on_sigterm(
        tmp_path: Path, signing_key: Ed25519PrivateKey, make_table: TableFactory) -> None:
    state = tmp_path / "state"
    table = load_verified(canonical_bytes(sign_table(make_table(version=21, edge="edge-cli"),
                                                     signing_key)),
                          [signing_key.public_key()])
    save_last_known_good(state, table)
    key_file = tmp_path / "cp.pub"
    key_file.write_bytes(public_key_pem(signing_key))
    port, admin_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "edge", "--name", "edge-cli", "--region", "local:test-1",
         "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin_port}",
         "--state-dir", str(state), "--public-key", str(key_file), "--no-probes",
         "--access-log", "off", "--log-level", "WARNING", "--plain-upstream"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT),
                       "MERIDIAN_EDGE_ADMIN_SECRET": ADMIN_SECRET.decode()},
        preexec_fn=die_with_parent())
    try:
        body = wait_until(lambda: admin_request(f"http://127.0.0.1:{admin_port}",
                                                "/admin/table", ADMIN_SECRET, timeout_s=10),
                          60, "the edge's admin listener answering",
                          ignore=(OSError,))  # refused, reset or timed out while it starts
        assert (body["version"], body["source"]) == (21, "disk")
        assert get(f"http://127.0.0.1:{port}/healthz") == (200, {"status": "ok",
                                                                  "table_version": 21})
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_bad_arguments_are_refused_with_the_reason(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "edge", "--name", "e", "--region", "nowhere", "--listen",
         "127.0.0.1:1", "--admin-listen", "127.0.0.1:2", "--state-dir", str(tmp_path),
         "--public-key", str(tmp_path / "missing.pem")],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode != 0
    assert "CLOUD:REGION" in result.stderr


def test_the_edge_does_not_start_without_an_admin_secret(tmp_path: Path,
                                                         signing_key: Ed25519PrivateKey) -> None:
    key_file = tmp_path / "cp.pub"
    key_file.write_bytes(public_key_pem(signing_key))
    env = {k: v for k, v in os.environ.items() if k != "MERIDIAN_EDGE_ADMIN_SECRET"}
    argv = [sys.executable, "-m", "edge", "--name", "e", "--region", "local:test-1",
            "--listen", "127.0.0.1:1", "--admin-listen", "127.0.0.1:2", "--state-dir",
            str(tmp_path), "--public-key", str(key_file)]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                            env={**env, "PYTHONPATH": str(ROOT)})
    assert result.returncode != 0
    assert "--admin-secret-file" in result.stderr and "MERIDIAN_EDGE_ADMIN_SECRET" in result.stderr
    short = tmp_path / "short-secret"
    short.write_text("abc")
    result = subprocess.run([*argv, "--admin-secret-file", str(short)], cwd=ROOT,
                            capture_output=True, text=True, env={**env, "PYTHONPATH": str(ROOT)})
    assert result.returncode != 0 and "at least 16 bytes" in result.stderr


def test_the_admin_listener_binds_loopback_when_its_host_is_left_out() -> None:
    assert admin_host_port(":9100") == ("127.0.0.1", 9100)
    assert admin_host_port("0.0.0.0:9100") == ("0.0.0.0", 9100)  # only when told so
    assert admin_host_port("[::1]:9100") == ("::1", 9100)
    assert host_port(":8080") == ("0.0.0.0", 8080)  # the client API is public
