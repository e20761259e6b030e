"""Routing: the edge registry, table compilation, signing, pushing and drift detection."""
