"""Refresh offer prices from a provider's catalog; keeps stored data when it is unreachable."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from controlplane.provisioning.services import get_provider
from regions.services import refresh_offers


class Command(BaseCommand):
    help = "Fold current prices from a provider (default: SkyPilot's catalog) into the offers."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--provider", default="skypilot", choices=["skypilot", "local"])

    def handle(self, *args: Any, **options: Any) -> None:
        report = refresh_offers(get_provider(options["provider"]))
        state = "refreshed" if report.ok else "NOT refreshed"
        self.stdout.write(f"{report.source}: {state}: {report.detail}")
        self.stdout.write(f"{report.stale_offers} offer(s) are stale")
