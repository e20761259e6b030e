"""Revoke a certificate the engine CA issued: never renewed again, refused by the edges."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.core.certificates import revoke


class Command(BaseCommand):
    help = "Revoke a certificate by serial (hex), with a reason for the audit log."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("serial")
        parser.add_argument("--reason", required=True)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            row = revoke(options["serial"], options["reason"], actor="system:manage.py")
        except (LookupError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"revoked {row.subject} serial {row.serial} at {row.revoked_at:%Y-%m-%d %H:%M:%S} UTC")
