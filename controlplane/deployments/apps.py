"""App config for the deployments app."""

from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "controlplane.deployments"
    label = "deployments"
    verbose_name = "Deployments and replicas"
