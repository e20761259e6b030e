"""App config for the core app."""

from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "controlplane.core"
    label = "core"
    verbose_name = "Core: tenants, roles, keys, audit"
