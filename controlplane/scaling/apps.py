"""App config for the scaling app."""

from django.apps import AppConfig


class ScalingConfig(AppConfig):
    name = "controlplane.scaling"
    label = "scaling"
    verbose_name = "Scaling"
