"""Alerts: rules over the fleet's state, Alert rows with open/resolved times, webhooks."""
