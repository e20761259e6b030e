"""App config for the telemetry app."""

from django.apps import AppConfig


class TelemetryConfig(AppConfig):
    name = "controlplane.telemetry"
    label = "telemetry"
    verbose_name = "Telemetry"
