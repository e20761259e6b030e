"""PrometheusSource against a real Prometheus scraping real engines: every named PromQL query
answers what a direct scrape of the same engine says.

Per engine (enginesim; the real vLLM CPU build where `make engine` made it): Prometheus
scrapes it every second; once it has seen the engine idle, streaming traffic runs while a
thread scrapes the engine directly every 0.1 s; then Prometheus is given time to scrape the
settled counters. Tolerances: counters and the settled gauges agree exactly; a gauge during
traffic lies within what the direct scrapes bracketing Prometheus's scrape saw, where no
request ended in between (the engine's success counter did not move); a rate over W seconds lies between increase/W and increase/(W - 2.2 intervals)
(PromQL extrapolates from the first and last samples in the window to its edges); a p95
equals the quantile of the direct scrapes' bucket deltas (every bucket shares timestamps, so
extrapolation scales them alike and cancels).
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.lab.waiting import wait_until
from controlplane.telemetry.engine_metrics import EngineSnapshot
from controlplane.telemetry.histograms import bucket_delta, histogram_quantile
from controlplane.telemetry.queries import MIN_WINDOW_S, QUERIES
from controlplane.telemetry.sources import PrometheusSource
from tests.telemetry.prometheus_harness import (
    ENGINES,
    JOB,
    SCRAPE_INTERVAL_S,
    Prometheus,
    Sampler,
    ScrapedEngine,
    run_prometheus,
    send_traffic,
)

pytestmark = pytest.mark.e2e


@dataclass
class Scenario:
    engine: ScrapedEngine
    prometheus: Prometheus
    source: PrometheusSource
    t0: float  # Prometheus has scraped the idle engine; `before` was scraped then
    before: EngineSnapshot
    traffic: tuple[float, float]  # when it started and ended
    during: list[tuple[float, float, EngineSnapshot]]
    after: EngineSnapshot
    after_text: str
    t_eval: float  # every query is evaluated at this time
    window_s: int  # from before t0 to t_eval

    def at_end(self, name: str, window_s: int | None = None) -> dict[str, float]:
        return self.source.query(name, window_s or self.window_s, at=self.t_eval)


def metrics_text(engine: ScrapedEngine) -> str:
    import urllib.request

    with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as response:
        return str(response.read().decode())


def counters(text: str) -> dict[str, float]:
    """Every vLLM counter the engine exposes, summed over its label sets (engine,
    model_name …). The process's and the HTTP server's own counters move while idle."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter" and family.name.startswith("vllm:"):
            for sample in family.samples:
                if sample.name == family.name + "_total":
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def prometheus_counter(s: Scenario, name: str) -> float | None:
    result = s.prometheus.api(f'sum({name}{{replica="{s.engine.replica}"}})', at=s.t_eval)
    return float(result[0]["value"][1]) if result else None  # type: ignore[index]


@pytest.fixture(scope="module", params=list(ENGINES))
def scenario(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    home = tmp_path_factory.mktemp(f"prometheus-{request.param}")
    with ENGINES[request.param](home) as engine, run_prometheus(home, [engine]) as prom:
        source = PrometheusSource(prom.url)
        scraped = f'count_over_time(up{{job="{JOB}",replica="{engine.replica}"}}[1m])'
        wait_until(lambda: bool(r := prom.api(scraped)) and float(r[0]["value"][1]) >= 2,  # type: ignore[index]
                   60, "two scrapes of the idle engine", every_s=0.2)
        t0, before = time.time(), engine.scrape()
        with Sampler(engine) as sampler:
            started = time.time()
            send_traffic(engine)
            ended = time.time()
            # The direct scrapes go on a while: the engine's gauges fall as its last
            # requests finish, before their clients have read the end, so a scrape by
            # Prometheus just before `ended` needs direct scrapes after it to compare with.
            wait_until(lambda: sum(sent >= ended for sent, _, _ in sampler.samples) >= 3, 60,
                       "three direct scrapes after the traffic")
        # Settled: two direct scrapes a scrape interval apart agree, and Prometheus has
        # scraped since the second.
        text = metrics_text(engine)
        while True:
            time.sleep(SCRAPE_INTERVAL_S)
            again = metrics_text(engine)
            if counters(again) == counters(text):
                break
            text = again
        settled_at = time.time()
        last_scrape = f'timestamp(up{{job="{JOB}",replica="{engine.replica}"}})'
        wait_until(lambda: float(prom.api(last_scrape)[0]["value"][1]) > settled_at,  # type: ignore[index]
                   60, "a scrape of the settled engine", every_s=0.2)
        t_eval = time.time()
        yield Scenario(engine, prom, source, t0, before, (started, ended), sampler.samples,
                       engine.scrape(), text, t_eval, math.ceil(t_eval - t0) + 2)


def test_counters_agree_exactly_once_scraped_after_traffic(scenario: Scenario) -> None:
    direct = counters(scenario.after_text)
    assert direct["vllm:generation_tokens_total"] > 0
    assert {name: prometheus_counter(scenario, name) for name in direct} == direct


def _check_up(s: Scenario) -> None:
    assert s.at_end("up") == {s.engine.replica: 1.0}


def _gauge(attr: str) -> Callable[[Scenario], None]:
    def check(s: Scenario) -> None:
        name = attr  # the gauges' queries are named after ReplicaStats' fields
        assert s.at_end(name) == {s.engine.replica: getattr(s.after, attr)}
        # During traffic, at each of Prometheus's scrapes (it began at ts and took `took`
        # seconds): within what the direct scrapes saw from the last one answered before it
        # to the first one sent after it, if no request ended in between (the engine's
        # success counter says so): until one ends, requests only arrive and grow, so both
        # gauges only rise. Evidence, not a clock tolerance: a loaded machine stretches the
        # sampler's 0.1 s, and a request that ended unseen in between (a dip of `running`
        # before its worker's next, `kv_usage` risen then freed) cannot be judged.
        window = (f'scrape_duration_seconds{{job="{JOB}",replica="{s.engine.replica}"}}'
                  f"[{s.window_s}s]")
        (series,) = s.prometheus.api(window, at=s.t_eval)
        # Only a scrape that succeeded carries the gauges: on a loaded machine one can time
        # out (`up` 0 at its timestamp, and the engine's series marked stale).
        (up,) = s.prometheus.api(window.replace("scrape_duration_seconds", "up", 1),
                                 at=s.t_eval)
        answered = {t for t, value in up["values"] if float(value) == 1}  # type: ignore[attr-defined]
        scrapes = [(float(t), float(took)) for t, took in series["values"]  # type: ignore[attr-defined]
                   if s.traffic[0] <= float(t) <= s.traffic[1] and t in answered]
        seen = []
        for ts, took in scrapes:
            # Only a scrape with direct scrapes on both sides of it can be judged.
            first = max((i for i, (_, read, _) in enumerate(s.during) if read <= ts),
                        default=None)
            last = min((i for i, (sent, _, _) in enumerate(s.during) if sent >= ts + took),
                       default=None)
            if first is None or last is None:
                continue
            bracket = [snap for _, _, snap in s.during[first:last + 1]]
            if bracket[0].counters["requests_ok"] == bracket[-1].counters["requests_ok"]:
                near = [getattr(snap, attr) for snap in bracket]
                got = s.source.query(name, s.window_s, at=ts)[s.engine.replica]
                assert min(near) - 1e-9 <= got <= max(near) + 1e-9, (ts, took, got, near)
                seen.append(got)
        assert len(seen) >= 2, (scrapes, s.traffic, [(a, b) for a, b, _ in s.during])
        if attr == "running":
            assert max(seen) > 0, "no scrape saw a request running"
    return check


def _rate(counter: str) -> Callable[[Scenario], None]:
    def check(s: Scenario) -> None:
        name = {"prompt_tokens": "prompt_tps", "generation_tokens": "generation_tps"}[counter]
        increase = s.after.counters[counter] - s.before.counters[counter]
        assert increase > 0
        got = s.at_end(name)[s.engine.replica]
        low = increase / s.window_s
        high = increase / (s.window_s - 2.2 * SCRAPE_INTERVAL_S)
        assert low * (1 - 1e-9) <= got <= high * (1 + 1e-9), (got, low, high)
    return check


def _p95(histogram: str) -> Callable[[Scenario], None]:
    def check(s: Scenario) -> None:
        name = f"{histogram}_p95_s"
        expected = histogram_quantile(0.95, bucket_delta(s.after.buckets[histogram],
                                                         s.before.buckets[histogram]))
        assert expected is not None
        assert s.at_end(name)[s.engine.replica] == pytest.approx(expected, rel=1e-3)
        # A window without observations: PromQL answers NaN, which the source leaves out.
        assert s.source.query(name, MIN_WINDOW_S, at=s.t0) == {}
    return check


CHECKS: dict[str, Callable[[Scenario], None]] = {
    "up": _check_up,
    "running": _gauge("running"),
    "waiting": _gauge("waiting"),
    "kv_usage": _gauge("kv_usage"),
    "ttft_p95_s": _p95("ttft"),
    "itl_p95_s": _p95("itl"),
    "prompt_tps": _rate("prompt_tokens"),
    "generation_tps": _rate("generation_tokens"),
}


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_named_query_agrees_with_a_direct_scrape(scenario: Scenario, name: str) -> None:
    CHECKS[name](scenario)


def test_replica_stats_through_prometheus(scenario: Scenario) -> None:
    s, replica = scenario, scenario.engine.replica
    window = math.ceil(time.time() - s.t0) + 2
    stats = s.source.replica_stats({replica: s.engine.url, "999": "http://127.0.0.1:9"}, window)
    mine = stats[replica]
    assert mine.up and not mine.error
    assert (mine.running, mine.waiting, mine.kv_usage) == (
        s.after.running, s.after.waiting, s.after.kv_usage)
    assert mine.prompt_tps > 0 and mine.generation_tps > 0
    assert mine.ttft_p95_s == pytest.approx(s.at_end("ttft_p95_s")[replica], rel=1e-3)
    assert mine.itl_p95_s == pytest.approx(s.at_end("itl_p95_s")[replica], rel=1e-3)
    assert not stats["999"].up and stats["999"].error == "not among Prometheus's targets yet"


LAB_CHILD = """
import sys, time
from pathlib import Path
from controlplane.lab.processes import ProcessGroup
from controlplane.lab.prometheus import free_port, start_prometheus
var = Path(sys.argv[1])
group = ProcessGroup(log_dir=var / "logs", env={})
url = start_prometheus(group, var, "127.0.0.1", free_port(), say=lambda m: None)
print(url, group.children[0].process.pid, flush=True)
time.sleep(600)
"""


def test_the_labs_prometheus_dies_with_the_lab(tmp_path: Path) -> None:
    """Killed outright (no Ctrl-C, no cleanup), the lab still takes Prometheus with it."""
    import shutil

    if shutil.which("prometheus") is None:
        pytest.skip("no prometheus binary")
    lab = subprocess.Popen([sys.executable, "-c", LAB_CHILD, str(tmp_path)],
                           stdout=subprocess.PIPE, text=True,
                           cwd=Path(__file__).resolve().parents[2])
    try:
        url, pid = lab.stdout.readline().split()  # type: ignore[union-attr]
        assert url.startswith("http://127.0.0.1:")
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"prometheus")
    finally:
        lab.kill()
        lab.wait(10)
    wait_until(lambda: not Path(f"/proc/{pid}").exists()
               or " Z " in Path(f"/proc/{pid}/stat").read_text(), 60, "Prometheus to exit",
               every_s=0.2, ignore=(FileNotFoundError,))  # gone between the two reads
