"""Each pytest-xdist worker's Redis database: apart from `make up`'s (0) and from the labs that
tests start (1-12), whatever form the base URL takes."""

from __future__ import annotations

import pytest

from controlplane.lab.backing import LAB_REDIS_DBS, WORKER_REDIS_DBS, lab_redis_db, worker_redis_url


@pytest.mark.parametrize(("base", "worker", "expected"), [
    ("redis://127.0.0.1:6379/0", "gw0", "redis://127.0.0.1:6379/13"),
    ("redis://127.0.0.1:6379", "gw1", "redis://127.0.0.1:6379/14"),
    ("redis://:secret@cache:6380/3", "gw2", "redis://:secret@cache:6380/15"),
    ("redis+socket:///srv/var/redis.sock", "gw1", "redis+socket:///srv/var/redis.sock?db=14"),
    ("unix:///tmp/redis.sock?db=2", "gw0", "unix:///tmp/redis.sock?db=13"),
])
def test_a_worker_gets_its_own_database_in_any_url_form(base: str, worker: str,
                                                        expected: str) -> None:
    assert worker_redis_url(base, worker) == expected


def test_workers_and_labs_never_share_a_database() -> None:
    workers = {int(worker_redis_url("redis://h:1/0", f"gw{n}").rsplit("/", 1)[1])
               for n in range(8)}
    labs = {lab_redis_db(port) for port in range(1024, 65536)}
    assert workers == set(WORKER_REDIS_DBS) and labs == set(range(1, LAB_REDIS_DBS + 1))
    assert not workers & labs and 0 not in workers | labs
