"""Create (or update) a user with a role and print a new API token on the last line."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.core.models import Role, Tenant
from controlplane.core.services import ensure_user, issue_api_token


class Command(BaseCommand):
    help = "Create the user if missing, set its role (and tenant), and print a new API token."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--role", required=True, choices=Role.values)
        parser.add_argument("--tenant", help="Confine the user to this tenant (by name).")
        parser.add_argument("--name", default="cli", help="A label for the token.")

    def handle(self, *args: Any, **options: Any) -> None:
        tenant = None
        if options["tenant"]:
            tenant = Tenant.objects.filter(name=options["tenant"]).first()
            if tenant is None:
                raise CommandError(f"--tenant: no tenant named {options['tenant']!r}")
        user = ensure_user(options["username"], options["role"], tenant)
        _, token = issue_api_token(user, options["name"])
        scope = f"tenant {tenant.name}" if tenant else "platform"
        self.stdout.write(f"user {user.get_username()}: role {options['role']}, {scope}")
        self.stdout.write(token)
