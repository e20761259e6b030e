"""Provisioning: the Provider protocol, local and SkyPilot providers, and provider jobs."""
