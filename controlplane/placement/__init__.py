"""Placement: the capacity model and the placement solver."""
