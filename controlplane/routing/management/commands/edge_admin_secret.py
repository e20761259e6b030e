"""Print an edge's admin secret, for its `--admin-secret-file` (routing/edge_secrets.py)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from controlplane.routing.edge_secrets import edge_secret


class Command(BaseCommand):
    help = ("Print the admin secret of the edge NAME: write it to a file only that edge reads "
            "and start it with --admin-secret-file.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the edge's name, as registered")

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write(edge_secret(options["name"]).decode())
