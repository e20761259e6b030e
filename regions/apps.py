"""App config for the regions app."""

from django.apps import AppConfig


class RegionsConfig(AppConfig):
    name = "regions"
    verbose_name = "Regions and GPU inventory"
