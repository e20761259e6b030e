"""Load the shipped GPU and model catalogs; running it twice changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.deployments.services import load_model_catalog, read_model_catalog
from regions.services import CATALOG_PATH, CatalogError, load_catalog, read_catalog


class Command(BaseCommand):
    help = "Load clouds, regions, GPU types, offers, quota and models from the shipped catalog."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--catalog", default=str(CATALOG_PATH), help="GPU catalog JSON file")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            data = read_catalog(Path(options["catalog"]))
            report = load_catalog(data)
            load_model_catalog(read_model_catalog(), report)
        except CatalogError as exc:
            raise CommandError(str(exc)) from exc
        if options["verbosity"] > 0:
            self.stdout.write(report.summary())
            self.stdout.write(f"catalog as of {data['as_of']}: {report.changed} row(s) changed")
