"""Models, deployments, replicas and their state machine."""
