"""Meridian's control plane: the Django project, its Celery app and the control-plane apps."""

from importlib.util import find_spec

# GPU nodes run `python -m controlplane.telemetry.gpu_agent` with only nvidia-ml-py installed;
# everywhere else Celery is present and its app must load with the package.
if find_spec("celery") is not None:
    from controlplane.celery import app as celery_app

    __all__ = ["celery_app"]
