"""PrometheusSource when Prometheus cannot answer: it never hangs a periodic task, and the
control plane's source stands the direct scrape in for it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Mapping

import pytest

from controlplane.lab.prometheus import free_port
from controlplane.telemetry.queries import MIN_WINDOW_S, QUERIES, render
from controlplane.telemetry.sources import PrometheusSource, PrometheusUnavailable, ReplicaStats


class Fallback:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def replica_stats(self, targets: Mapping[str, str], window_s: int) -> dict[str, ReplicaStats]:
        self.calls.append(window_s)
        return {t: ReplicaStats(up=True, running=3.0) for t in targets}


def test_an_unreachable_prometheus_falls_back_at_once() -> None:
    fallback = Fallback()
    source = PrometheusSource(f"http://127.0.0.1:{free_port()}", timeout_s=1, fallback=fallback)
    stats = source.replica_stats({"4": "http://127.0.0.1:9"}, 60)
    assert stats == {"4": ReplicaStats(up=True, running=3.0)} and fallback.calls == [60]


def test_a_failing_query_is_not_retried() -> None:
    """A Prometheus that drops every connection is asked once, then the fallback answers
    (the client's default would retry three times with backoff)."""
    connections = 0
    done = threading.Event()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.settimeout(0.05)  # so that the loop sees `done`

        def drop_all() -> None:
            nonlocal connections
            while not done.is_set():
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                connections += 1
                conn.close()

        thread = threading.Thread(target=drop_all, daemon=True)
        thread.start()
        fallback = Fallback()
        source = PrometheusSource(f"http://127.0.0.1:{server.getsockname()[1]}", timeout_s=30,
                                  fallback=fallback)
        assert source.replica_stats({"4": "http://127.0.0.1:9"}, 60)["4"].running == 3.0
        assert fallback.calls == [60]
        done.set()
        thread.join(30)
    assert connections == 1


def test_without_a_fallback_the_failure_names_prometheus() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(PrometheusUnavailable, match=f"Prometheus at {url} did not answer"):
        PrometheusSource(url, timeout_s=1).replica_stats({"4": "http://127.0.0.1:9"}, 60)


def test_rate_windows_hold_two_scrapes_at_least() -> None:
    assert render("prompt_tps", 1) == render("prompt_tps", MIN_WINDOW_S)
    assert "[60s]" in render("prompt_tps", 60)
    assert all("[" not in render(name, 60) for name in ("up", "running", "waiting", "kv_usage"))
    assert set(QUERIES) >= {"up", "ttft_p95_s", "itl_p95_s", "prompt_tps", "generation_tps"}


def test_every_named_query_is_checked_against_a_real_prometheus() -> None:
    from tests.telemetry.test_prometheus_real import CHECKS

    assert set(CHECKS) == set(QUERIES)


def test_the_control_plane_reads_prometheus_when_it_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane.telemetry.services import DirectScrapeSource, metrics_source

    monkeypatch.delenv("PROMETHEUS_URL", raising=False)
    assert isinstance(metrics_source(), DirectScrapeSource)
    monkeypatch.setenv("PROMETHEUS_URL", "http://127.0.0.1:9090")
    source = metrics_source()
    assert isinstance(source, PrometheusSource) and source.url == "http://127.0.0.1:9090"
    assert isinstance(source.fallback, DirectScrapeSource)
