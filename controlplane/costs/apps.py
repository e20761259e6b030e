"""App config for the costs app."""

from django.apps import AppConfig


class CostsConfig(AppConfig):
    name = "controlplane.costs"
    label = "costs"
    verbose_name = "Costs and budgets"
