"""`manage.py failover_drill REGION`: kill a local region's replicas and follow the failover.

Prints each stage of the timeline as it is reached (detected, tables pushed, replacements
ready, traffic back, resolved) with seconds since the kill. The watch loop and the workers
that launch replacements must be running (`make up` runs them); `--no-wait` only starts
the drill.
"""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.failover.models import Incident
from controlplane.failover.services import STAGES, DrillRefused, region_by_key, start_drill


class Command(BaseCommand):
    help = "Kill every replica of a local lab region and print the failover timeline."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("region", help="cloud:code of a local region, e.g. local:ap-tokyo")
        parser.add_argument("--actor", default="cli", help="who started it, for the audit log")
        parser.add_argument("--timeout", type=float, default=180.0,
                            help="seconds to follow the timeline before giving up")
        parser.add_argument("--no-wait", action="store_true", help="start the drill and return")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            incident = start_drill(region_by_key(options["region"]), actor=options["actor"])
        except DrillRefused as exc:
            raise CommandError(f"{exc.field}: {exc.message}") from None
        self.stdout.write(f"drill #{incident.pk}: {incident.summary}")
        if options["no_wait"]:
            return
        seen: set[str] = set()
        deadline = time.monotonic() + options["timeout"]
        while time.monotonic() < deadline:
            incident = Incident.objects.get(pk=incident.pk)
            for stage in STAGES:
                at = getattr(incident, stage)
                if at is not None and stage not in seen:
                    seen.add(stage)
                    seconds = (at - incident.started_at).total_seconds()
                    self.stdout.write(f"  +{seconds:7.2f} s  {stage.removesuffix('_at').replace('_', ' ')}")
            if incident.resolved_at is not None:
                self.stdout.write(self.style.SUCCESS(
                    f"drill #{incident.pk} resolved; replacements: "
                    f"{', '.join(incident.replacements) or 'none'}"))
                return
            time.sleep(0.25)
        raise CommandError(f"drill #{incident.pk} not resolved after {options['timeout']:.0f} s; "
                           f"stages reached: {', '.join(sorted(seen)) or 'none'} — are the "
                           "workers and beat running (make up)?")
