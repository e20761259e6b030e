"""The control plane's settings in lab mode (MERIDIAN_LAB=1), for tools that load Django
without the lab's environment: mypy's Django plugin (pyproject's [tool.django-stubs]).
Production is controlplane.settings itself, which refuses to start without its secrets."""

import os

os.environ.setdefault("MERIDIAN_LAB", "1")

from controlplane.settings import *  # noqa: E402, F403
