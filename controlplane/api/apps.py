"""App config for the API app."""

from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "controlplane.api"
    label = "api"
    verbose_name = "REST API"
