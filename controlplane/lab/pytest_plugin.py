"""Loaded by pytest before Django is set up (`-p controlplane.lab.pytest_plugin` in pyproject's
addopts; an installed module, so a bare `pytest` finds it too): a test run is the lab
(MERIDIAN_LAB=1: lab-only secrets, plain HTTP), and so is every process it starts. Production
mode is tested on purpose, in subprocesses with MERIDIAN_LAB=0
(tests/security/test_production_settings.py).

Under pytest-xdist (`make test` runs `-n`), each worker gets a Redis database of its own
(`backing.worker_redis_url`), as pytest-django gives each its own test database, so that rate
limits, concurrency counters and queues of one worker never meet another's."""

import os

from controlplane.lab import backing

os.environ.setdefault("MERIDIAN_LAB", "1")
# Tests' fake engines and lab pieces speak plain HTTP unless a test turns mTLS on itself
# (tests/provisioning/test_engine_tls.py, tests/contract/test_real_engine_mtls.py); the lab
# (`python -m controlplane.lab`) always turns it on.
os.environ.setdefault("MERIDIAN_ENGINE_TLS", "0")

_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker:
    os.environ["REDIS_URL"] = backing.worker_redis_url(
        os.environ.get("REDIS_URL") or backing.lab_redis_url(), _worker)
