"""Tenants, users and roles, API tokens and keys, the audit log and shared helpers."""
