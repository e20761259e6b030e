"""Issue a certificate from the engine CA into a directory (an edge's, or Prometheus's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.core import ca
from controlplane.core.certificates import issue


class Command(BaseCommand):
    help = ("Issue a client certificate (an edge: --subject edge:NAME; Prometheus: "
            "--subject scraper:prometheus) or a server one, and write cert.pem, key.pem and "
            "ca.pem into --out; renewal rewrites them there before they expire.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--subject", required=True, help="e.g. edge:edge-eu")
        parser.add_argument("--kind", choices=ca.KINDS, default="client")
        parser.add_argument("--address", action="append", default=[],
                            help="an IP or DNS name for the subjectAltName (server: required)")
        parser.add_argument("--out", type=Path, required=True)

    def handle(self, *args: Any, **options: Any) -> None:
        subject = options["subject"]
        try:
            row, _ = issue(subject, options["kind"], subject.split(":", 1)[-1],
                           options["address"], options["out"])
        except (ValueError, ca.CertificateProblem) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"{row.kind} certificate for {row.subject}: serial {row.serial}, "
                          f"valid until {row.not_after:%Y-%m-%d %H:%M} UTC, in {options['out']}")
