"""App config for the rollouts app."""

from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "controlplane.rollouts"
    label = "rollouts"
    verbose_name = "Rollouts"
