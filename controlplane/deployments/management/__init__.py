"""Management commands of the deployments app."""
