"""The lab's database on its server, created before Django is set up (controlplane/lab/seed.py
fills it once Django is)."""

from __future__ import annotations

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from controlplane.env import database_from_url


def ensure_database(url: str) -> bool:
    """Create the database named in `url` if the server lacks it; True when created."""
    params = database_from_url("DATABASE_URL", url)
    conninfo = {
        "dbname": "postgres", "user": str(params["USER"]), "password": str(params["PASSWORD"]),
        "host": str(params["HOST"]), "port": str(params["PORT"]),
    }
    dsn = make_conninfo(**{k: v for k, v in conninfo.items() if v})
    with psycopg.connect(dsn, autocommit=True) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [params["NAME"]]
        ).fetchone()
        if exists:
            return False
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(str(params["NAME"]))))
        return True
