"""App config for the plans app."""

from django.apps import AppConfig


class PlansConfig(AppConfig):
    name = "controlplane.plans"
    label = "plans"
    verbose_name = "Plans: approval, application, replanning"
