"""`manage.py failover_drill REGION`: kill a local region's replicas and follow the failover.

Prints each stage of the timeline the moment it is reached (detected, tables pushed,
replacements requested with where they go and why, replacements ready, traffic back,
resolved), with seconds since the kill, flushing every line so a pipe or a log sees it at
once. At the end it says why any stage is missing (`timeline.missing`), never a bare
null. The watch loop and the workers that launch replacements must be running (`make up`
runs them); `--no-wait` only starts the drill.
"""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.failover.drills import DrillRefused, region_by_key, start_drill
from controlplane.failover.models import Incident
from controlplane.failover.timeline import MEANINGS, STAGES, missing, stage_name


class Command(BaseCommand):
    help = "Kill every replica of a local lab region and print the failover timeline."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("region", help="cloud:code of a local region, e.g. local:ap-tokyo")
        parser.add_argument("--actor", default="cli", help="who started it, for the audit log")
        parser.add_argument("--timeout", type=float, default=180.0,
                            help="seconds to follow the timeline before giving up")
        parser.add_argument("--no-wait", action="store_true", help="start the drill and return")
        parser.add_argument("--poll", type=float, default=0.25,
                            help="seconds between reads of the incident")

    def say(self, text: str) -> None:
        self.stdout.write(text)
        self.stdout.flush()

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            incident = start_drill(region_by_key(options["region"]), actor=options["actor"])
        except DrillRefused as exc:
            raise CommandError(f"{exc.field}: {exc.message}") from None
        self.say(f"drill #{incident.pk}: {incident.summary}")
        if options["no_wait"]:
            return
        seen: set[str] = set()
        notes_seen = len(incident.notes)
        deadline = time.monotonic() + options["timeout"]
        while time.monotonic() < deadline:
            incident = Incident.objects.get(pk=incident.pk)
            for _, text in incident.notes[notes_seen:]:
                if text.startswith(("replacement", "no replacement", "region is down")):
                    self.say(f"            {text}")
            notes_seen = len(incident.notes)
            for stage in STAGES:
                at = getattr(incident, stage)
                if at is not None and stage not in seen:
                    seen.add(stage)
                    seconds = (at - incident.started_at).total_seconds()
                    self.say(f"  +{seconds:7.2f} s  {stage_name(stage)}")
            if incident.resolved_at is not None:
                for stage, why in missing(incident).items():
                    self.say(f"  {stage.replace('_', ' ')}: — ({why})")
                self.say(self.style.SUCCESS(
                    f"drill #{incident.pk} resolved ({MEANINGS['resolved']}); replacements: "
                    f"{', '.join(incident.replacements) or 'none'}"))
                return
            time.sleep(options["poll"])
        raise CommandError(f"drill #{incident.pk} not resolved after {options['timeout']:.0f} s; "
                           f"stages reached: {', '.join(sorted(seen)) or 'none'} — are the "
                           "workers and beat running (make up)?")
