"""App config for the batches app."""

from django.apps import AppConfig


class BatchesConfig(AppConfig):
    name = "controlplane.batches"
    label = "batches"
    verbose_name = "Batches"
