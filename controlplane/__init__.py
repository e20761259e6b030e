"""Meridian's control plane: the Django project, its Celery app and the control-plane apps."""

from controlplane.celery import app as celery_app

__all__ = ["celery_app"]
