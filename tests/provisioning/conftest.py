"""Fixtures for provider tests: lab regions, a LocalProvider over a throwaway state dir, and
small TCP servers to relay to. Every process a test starts is stopped in teardown."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controlplane.provisioning.local import LocalProvider
from controlplane.provisioning.local_regions import LabRegion

os.environ.setdefault("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")

REPO_ROOT = Path(__file__).resolve().parents[2]

# Three lab regions on three continents, at their real regions' coordinates.
LAB_REGIONS = [
    LabRegion("local:eu-frankfurt", 50.11, 8.68, price_usd_h=4.0),
    LabRegion("local:us-virginia", 38.95, -77.45),
    LabRegion("local:ap-tokyo", 35.68, 139.77),
]


@pytest.fixture
def lab_regions() -> list[LabRegion]:
    return list(LAB_REGIONS)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "replicas"


@pytest.fixture
def local_provider(state_dir: Path, lab_regions: list[LabRegion]) -> Iterator[LocalProvider]:
    provider = LocalProvider(state_dir, lab_regions, engine="enginesim", grace_s=2.0)
    yield provider
    # Whatever a test left running: no replica is wanted any more.
    LocalProvider(state_dir, lab_regions, grace_s=1.0).reap(wanted=set())


@pytest.fixture
def enginesim() -> None:
    """Skip (saying why) where the engine simulator is not part of this checkout."""
    if not (REPO_ROOT / "enginesim" / "__main__.py").exists() and (
            importlib.util.find_spec("enginesim") is None):
        pytest.skip("enginesim is not in this checkout: LocalProvider has no engine to run")


def echo(conn: socket.socket) -> None:
    """Send back whatever arrives, as it arrives (for round-trip times)."""
    while data := conn.recv(65536):
        conn.sendall(data)


def digest(conn: socket.socket) -> None:
    """Read until the client half-closes, then answer with the SHA-256 of what arrived, so a
    test can push megabytes one way without reading at the same time."""
    hasher = hashlib.sha256()
    while data := conn.recv(65536):
        hasher.update(data)
    conn.sendall(hasher.hexdigest().encode())


class TcpServer:
    """A threaded TCP server on a free loopback port; `answer` handles one connection."""

    def __init__(self, answer: Callable[[socket.socket], None]) -> None:
        self.answer = answer
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = int(self.sock.getsockname()[1])
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                self.answer(conn)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


@pytest.fixture
def echo_server() -> Iterator[TcpServer]:
    server = TcpServer(echo)
    yield server
    server.close()


@pytest.fixture
def digest_server() -> Iterator[TcpServer]:
    server = TcpServer(digest)
    yield server
    server.close()
