"""App config for the provisioning app."""

from django.apps import AppConfig


class ProvisioningConfig(AppConfig):
    name = "controlplane.provisioning"
    label = "provisioning"
    verbose_name = "Provisioning: provider jobs"
