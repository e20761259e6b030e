"""App config for the placement app."""

from django.apps import AppConfig


class PlacementConfig(AppConfig):
    name = "controlplane.placement"
    label = "placement"
    verbose_name = "Placement: plans"
