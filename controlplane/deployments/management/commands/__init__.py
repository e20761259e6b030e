"""`manage.py` commands for deployments."""
