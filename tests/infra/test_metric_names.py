"""docs/metrics.md lists exactly the metrics Meridian exports: a running edge's /metrics (names,
types, labels, and when each family has its first sample) and the control plane's (none)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.test import Client
from django.urls import Resolver404, resolve

from controlplane.telemetry import engine_metrics
from edge.local import build_table, replica_entry
from tests.edge.fake_engine import Behaviour, FakeEngine
from tests.edge.helpers import EdgeUnderTest, running_edge

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
API_KEY = "sk-test"
TENANT = {"tenant": "acme", "jurisdictions": ["EU"], "rpm": 0, "tpm": 0, "models": ["*"],
          "tier": "interactive"}


@dataclass(frozen=True)
class Row:
    kind: str
    labels: tuple[str, ...]
    sampled_from: str


def documented() -> dict[str, Row]:
    """The rows of docs/metrics.md's tables of Meridian's own metrics, by name."""
    rows = {}
    for line in DOC.read_text().splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not cells[0].startswith("`meridian_"):
            continue
        name, kind, labels, sampled_from = (c.strip("`") for c in cells[:4])
        assert name not in rows, f"{name} listed twice"
        rows[name] = Row(kind, tuple(re.findall(r"`([a-z_]+)`", cells[2])), sampled_from)
    return rows


def families(text: str) -> dict[str, str]:
    """Each family's type, from its `# TYPE` line."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))


def sampled(text: str) -> dict[str, set[str]]:
    """The families with samples, and the labels those samples carry (`le` aside)."""
    names = families(text)
    found: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
        assert series is not None, line
        name = series.group(1)
        family = name if name in names else re.sub(r"_(bucket|sum|count)$", "", name)
        assert family in names, line
        labels = set(re.findall(r'([a-z_]+)="', series.group(2) or "")) - {"le"}
        found.setdefault(family, set()).update(labels)
    return found


async def scrape(edge: EdgeUnderTest) -> str:
    async with edge.session.get(edge.admin_url + "/metrics") as response:
        assert response.status == 200
        return await response.text()


def test_the_edge_exports_every_documented_metric_and_no_other(
        tmp_path: Path) -> None:
    rows = documented()
    edge_rows = {name: row for name, row in rows.items() if name.startswith("meridian_edge_")}
    key = Ed25519PrivateKey.generate()
    stages: list[tuple[str, str]] = []

    async def scenario() -> None:
        # Gaps between the stream's events, so that the edge writes each on its own (an
        # inter-token latency is a gap between two writes).
        engine = FakeEngine("m", Behaviour(event_gap_s=0.01))
        await engine.start()
        try:
            async with running_edge(key, tmp_path / "state") as edge:
                stages.append(("start", await scrape(edge)))
                table = build_table(1, "edge-test", {"m": [replica_entry("r1", engine.url)]},
                                    {API_KEY: TENANT})
                status, body = await edge.push(table, key)
                assert status == 200, body
                stages.append(("a table", await scrape(edge)))
                response = await edge.chat("m", stream=True,
                                           stream_options={"include_usage": True})
                assert response.status == 200
                await response.read()
                stages.append(("a request", await scrape(edge)))
                declared = {m.name: m.label_names for m in edge.edge.metrics.registry.metrics}
        finally:
            await engine.stop()
        # The labels each metric is declared with are the documented ones.
        assert {n: tuple(labels) for n, labels in declared.items()} == \
            {n: row.labels for n, row in edge_rows.items()}

    asyncio.run(scenario())
    for _, text in stages:
        # Every family is listed from the start, labelled or not, with the documented type.
        assert families(text) == {name: row.kind for name, row in edge_rows.items()}
    reached: set[str] = set()
    for stage, text in stages:
        reached.add(stage)
        present = sampled(text)
        assert set(present) == {n for n, row in edge_rows.items() if row.sampled_from in reached}, \
            f"after {stage}"
        for name, labels in present.items():
            assert labels == set(edge_rows[name].labels), name
    # What comes later is one of the documented occasions.
    assert {row.sampled_from for row in edge_rows.values()} <= {
        "start", "a table", "a request", "a rollout", "an event"}


@pytest.mark.django_db
def test_the_control_plane_exports_what_the_table_lists(client: Client) -> None:
    """The control plane serves no /metrics, and the table lists none of its own; a metrics
    view added later would have its families held to the table here."""
    own = {name for name in documented() if not name.startswith("meridian_edge_")}
    exported: set[str] = set()
    for path in ("/metrics", "/metrics/"):
        try:
            resolve(path)
        except Resolver404:
            continue
        response = client.get(path)
        assert response.status_code == 200, path
        exported |= {n for n in families(response.content.decode()) if n.startswith("meridian_")}
    assert exported == own
    assert client.get("/metrics").status_code == 404


def test_the_documented_engine_metrics_are_vllms() -> None:
    """The engines' table names what Meridian reads from vLLM (telemetry.engine_metrics)."""
    read = {*engine_metrics.GAUGES, *engine_metrics.COUNTERS,
            *(name.removesuffix("_bucket") for name in engine_metrics.HISTOGRAMS)}
    listed = set(re.findall(r"^\| `(vllm:[a-z0-9_]+)` \|", DOC.read_text(), flags=re.MULTILINE))
    assert listed == read
