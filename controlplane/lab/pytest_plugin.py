"""Loaded by pytest before Django is set up (`-p controlplane.lab.pytest_plugin` in pyproject's
addopts; an installed module, so a bare `pytest` finds it too): a test run is the lab
(MERIDIAN_LAB=1: lab-only secrets, plain HTTP), and so is every process it starts. Production
mode is tested on purpose, in subprocesses with MERIDIAN_LAB=0
(tests/security/test_production_settings.py)."""

import os

os.environ.setdefault("MERIDIAN_LAB", "1")
# Tests' fake engines and lab pieces speak plain HTTP unless a test turns mTLS on itself
# (tests/provisioning/test_engine_tls.py, tests/contract/test_real_engine_mtls.py); the lab
# (`python -m controlplane.lab`) always turns it on.
os.environ.setdefault("MERIDIAN_ENGINE_TLS", "0")
