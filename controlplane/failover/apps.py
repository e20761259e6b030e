"""App config for the failover app."""

from django.apps import AppConfig


class FailoverConfig(AppConfig):
    name = "controlplane.failover"
    label = "failover"
    verbose_name = "Failover and drills"
