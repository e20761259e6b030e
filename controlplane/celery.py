"""The Celery app: two queues, `control` for fast loops and `provision` for slow provider jobs."""

from __future__ import annotations

import os

from celery import Celery
from kombu import Queue

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("meridian")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_queues = (Queue("control"), Queue("provision"))
app.autodiscover_tasks()
