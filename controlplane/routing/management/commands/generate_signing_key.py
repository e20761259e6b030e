"""Generate the control plane's Ed25519 table-signing key (and its public key for edges)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.routing import edge_secrets
from controlplane.routing.signing import default_key_path, generate_key_files


class Command(BaseCommand):
    help = ("Write a new Ed25519 private key (0600) and its public key for the edges, and the "
            "edge admin key if there is none.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--path", type=Path, default=None, help="private key file")
        parser.add_argument("--force", action="store_true", help="replace an existing key")

    def handle(self, *args: Any, **options: Any) -> None:
        path = options["path"] or default_key_path()
        try:
            private, public = generate_key_files(path, overwrite=options["force"])
        except FileExistsError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"private key: {private} (keep it secret; never commit it)")
        self.stdout.write(f"public key:  {public} (give it to every edge: --public-key)")
        admin = edge_secrets.generate_key_file(edge_secrets.default_key_path())
        self.stdout.write(f"edge admin key: {admin} (kept if it existed; each edge's admin "
                          "secret is derived from it: manage.py edge_admin_secret NAME)")
