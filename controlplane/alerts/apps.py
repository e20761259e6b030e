"""App config for the alerts app."""

from django.apps import AppConfig


class AlertsConfig(AppConfig):
    name = "controlplane.alerts"
    label = "alerts"
    verbose_name = "Alerts"
