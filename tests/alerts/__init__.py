"""Tests of the alerts app."""
