"""Generate the engine CA (its certificate and key) that the data plane's mTLS trusts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.core.certificates import ca_dir, generate_ca_files


class Command(BaseCommand):
    help = "Write a new engine CA certificate and its key (0600) into MERIDIAN_CA_DIR."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dir", type=Path, default=None, help="default: MERIDIAN_CA_DIR")
        parser.add_argument("--force", action="store_true", help="replace an existing CA")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            cert, key = generate_ca_files(options["dir"] or ca_dir(), overwrite=options["force"])
        except FileExistsError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"CA certificate: {cert} (engines, edges and Prometheus trust it)")
        self.stdout.write(f"CA key:         {key} (keep it secret; never commit it)")
