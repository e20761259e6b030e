"""Edge counters: parsed from the edge's own /metrics text, stored per scrape, and differenced
with counter resets handled."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from controlplane.telemetry.edge_metrics import counter_delta, parse_edge_metrics, split_key
from edge.metrics import EdgeMetrics


def edge_text(requests: int, tokens: int) -> bytes:
    metrics = EdgeMetrics()
    for _ in range(requests):
        metrics.requests.inc(("chat", "local:eu-frankfurt", "acme", "200"))
    metrics.requests.inc(("chat", "local:eu-frankfurt", "acme", "503"))
    metrics.tokens.inc(("chat", "local:eu-frankfurt", "acme", "prompt"), tokens)
    metrics.table_version.set((), 42)
    metrics.ttft.observe(("chat",), 0.12)
    return metrics.registry.render()


def test_the_edges_own_text_parses_into_keyed_counters() -> None:
    snap = parse_edge_metrics(edge_text(3, 250).decode())
    assert snap.requests == {"chat|local:eu-frankfurt|acme|200": 3.0,
                             "chat|local:eu-frankfurt|acme|503": 1.0}
    assert snap.tokens == {"chat|local:eu-frankfurt|acme|prompt": 250.0}
    assert snap.table_version == 42 and snap.buckets["ttft"]["+Inf"] == 1.0
    assert split_key("chat|local:eu-frankfurt|acme|prompt", ("model", "region", "tenant", "kind")) \
        == {"model": "chat", "region": "local:eu-frankfurt", "tenant": "acme", "kind": "prompt"}


def test_deltas_count_growth_and_treat_a_shrunk_counter_as_a_restart() -> None:
    assert counter_delta({"a": 10.0, "b": 5.0}, {"a": 4.0, "b": 5.0}) == {"a": 6.0}
    assert counter_delta({"a": 3.0}, {"a": 40.0}) == {"a": 3.0}  # the edge restarted
    assert counter_delta({"a": 3.0}, None) == {"a": 3.0}


@pytest.mark.django_db
def test_collect_edges_stores_a_sample_and_returns_what_changed(catalog) -> None:  # type: ignore[no-untyped-def]
    from controlplane.routing.models import Edge
    from controlplane.telemetry.models import EdgeSample
    from controlplane.telemetry.services import collect_edges

    body = {"text": edge_text(2, 100)}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body["text"])

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        edge = Edge.objects.create(name="e1", region=catalog["fra"],
                                   admin_url=f"http://127.0.0.1:{server.server_address[1]}")
        down = Edge.objects.create(name="e2", region=catalog["fra"], admin_url="http://127.0.0.1:9")
        assert collect_edges() == []  # nothing to compare with yet
        body["text"] = edge_text(5, 160)
        (delta,) = collect_edges()
        assert delta.edge_id == edge.pk
        assert delta.requests == {"chat|local:eu-frankfurt|acme|200": 3.0}
        assert delta.tokens == {"chat|local:eu-frankfurt|acme|prompt": 60.0}
        assert EdgeSample.objects.filter(edge=edge, up=True).count() == 2
        assert EdgeSample.objects.filter(edge=down, up=False).count() == 2
    finally:
        server.shutdown()
        server.server_close()
