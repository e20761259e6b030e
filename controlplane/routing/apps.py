"""App config for the routing app."""

from django.apps import AppConfig


class RoutingConfig(AppConfig):
    name = "controlplane.routing"
    label = "routing"
    verbose_name = "Routing: edges and tables"

    def ready(self) -> None:
        from controlplane.routing import signals  # noqa: F401  (connects change hooks)
