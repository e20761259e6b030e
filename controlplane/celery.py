"""The Celery app: three queues, `control` for fast loops, `provision` for slow provider jobs
and `batch` for the batch runner (a run holds its worker for up to BATCH_TASK_BUDGET_S)."""

from __future__ import annotations

import os

from celery import Celery
from kombu import Queue

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("meridian")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_queues = (Queue("control"), Queue("provision"), Queue("batch"))
app.autodiscover_tasks()
