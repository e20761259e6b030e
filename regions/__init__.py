"""Clouds, regions (with geography and jurisdiction), GPU types, offers and quota."""
