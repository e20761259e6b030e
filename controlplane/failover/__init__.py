"""Failover: region and replica health, failover and drain, drills."""
