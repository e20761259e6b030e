"""Telemetry: metrics sources (direct scrape, Prometheus), stored samples, windowed stats."""
