"""Alerts."""
