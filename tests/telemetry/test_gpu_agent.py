"""The GPU agent against a fake NVML (the `pynvml` module it imports) and the real API."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from controlplane.telemetry import gpu_agent
from tests.telemetry.fake_nvml import FakeGpu, FakeNvml

H100 = FakeGpu()


@pytest.fixture
def fake(monkeypatch):  # type: ignore[no-untyped-def]
    nvml = FakeNvml([FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb", temperature=52)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module)
    return nvml


def test_the_fake_only_uses_names_real_pynvml_has():  # type: ignore[no-untyped-def]
    import pynvml

    fake = FakeNvml().module
    missing = [name for name in vars(fake) if not name.startswith("__")
               and not hasattr(pynvml, name)]
    assert missing == []


def test_a_reading_per_gpu_with_units_converted(fake):  # type: ignore[no-untyped-def]
    sampler = gpu_agent.GpuSampler.open(gpu_agent.load_nvml())
    report = gpu_agent.build_report(sampler, "n1", "r-3", 15.0)
    sampler.close()
    assert fake.shutdowns == 1
    assert report["node"] == "n1" and report["replica"] == "r-3"
    assert report["driver_version"] == "550.54.15" and report["cuda_driver_version"] == 12040
    first, second = report["gpus"]
    assert first == {
        "index": 0, "uuid": "GPU-aaaa", "name": "NVIDIA H100 80GB HBM3",
        "memory_total_bytes": 85_520_809_984, "memory_used_bytes": 1_048_576_000,
        "utilization_gpu_pct": 37.0, "utilization_memory_pct": 12.0, "temperature_c": 41.0,
        "power_w": 118.25, "power_limit_w": 700.0, "ecc_corrected": 0, "ecc_uncorrected": 0,
        "xid_supported": True, "xid_errors": [], "lost": False,
    }
    assert second["index"] == 1 and second["temperature_c"] == 52.0


def test_ecc_is_null_when_off_or_unsupported_and_other_figures_stay(fake):  # type: ignore[no-untyped-def]
    fake.gpus[0].ecc_enabled = False
    fake.gpus[1].ecc_enabled = None
    fake.gpus[1].unsupported = {"nvmlDeviceGetPowerUsage"}
    sampler = gpu_agent.GpuSampler.open(fake.module)
    first, second = sampler.read()
    assert first["ecc_corrected"] is None and first["ecc_uncorrected"] is None
    assert second["ecc_corrected"] is None and second["power_w"] is None
    assert second["power_limit_w"] == 700.0 and "errors" not in second


def test_xid_events_are_drained_per_gpu_between_readings(fake):  # type: ignore[no-untyped-def]
    sampler = gpu_agent.GpuSampler.open(fake.module)
    assert fake.registered == [0, 1]
    fake.xid(1, 79)
    fake.xid(1, 13)
    first = sampler.read(wait_ms=50)
    assert [g["xid_errors"] for g in first] == [[], [79, 13]]
    assert fake.waits[0] == 50 and fake.waits[1:] == [0, 0]  # only the first wait waits
    assert [g["xid_errors"] for g in sampler.read()] == [[], []]


def test_no_event_support_means_no_xids_and_says_so(fake):  # type: ignore[no-untyped-def]
    fake.gpus[0].events_supported = False
    sampler = gpu_agent.GpuSampler.open(fake.module)
    fake.xid(0, 48)
    first, second = sampler.read()
    assert first["xid_supported"] is False and first["xid_errors"] == []
    assert second["xid_supported"] is True


def test_a_lost_gpu_is_reported_lost(fake):  # type: ignore[no-untyped-def]
    sampler = gpu_agent.GpuSampler.open(fake.module)
    fake.gpus[0].lost = True
    first, second = sampler.read()
    assert first["lost"] is True and first["temperature_c"] is None
    assert first["errors"]["temperature_c"] == "GPU is lost"
    assert second["lost"] is False


@pytest.mark.parametrize(("error", "words"), [
    ("LibraryNotFound", "no NVIDIA driver"),
    ("DriverNotLoaded", "driver is not loaded"),
])
def test_no_driver_is_a_clear_error_and_exit_2(monkeypatch, capsys, error, words):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(init_error=error).module)
    assert gpu_agent.main(["--node", "n1", "--print", "--once"]) == gpu_agent.EXIT_NO_NVML
    err = capsys.readouterr().err
    assert "NVML is not available" in err and words in err


def test_missing_package_is_a_clear_error(monkeypatch, capsys):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert gpu_agent.main(["--node", "n1", "--print", "--once"]) == gpu_agent.EXIT_NO_NVML
    assert "nvidia-ml-py is not installed" in capsys.readouterr().err


def test_no_gpus_is_an_error(monkeypatch, capsys):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(gpus=[]).module)
    assert gpu_agent.main(["--node", "n1", "--print", "--once"]) == gpu_agent.EXIT_NO_NVML
    assert "no GPUs" in capsys.readouterr().err


def test_print_writes_one_json_line_per_reading(fake, capsys):  # type: ignore[no-untyped-def]
    assert gpu_agent.main(["--node", "n1", "--print", "--once"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    assert [g["uuid"] for g in json.loads(lines[0])["gpus"]] == ["GPU-aaaa", "GPU-bbbb"]


def test_arguments_are_checked(fake, capsys):  # type: ignore[no-untyped-def]
    for argv, words in ((["--node", "n1"], "give --api"),
                        (["--node", "n1", "--api", "ftp://x"], "http(s) URL"),
                        (["--node", "n1", "--api", "http://x"], "needs a token"),
                        (["--node", "n1", "--print", "--interval", "0"], "positive")):
        with pytest.raises(SystemExit) as exit_:
            gpu_agent.main(argv)
        assert exit_.value.code == 2
        assert words in capsys.readouterr().err


def test_report_url_accepts_base_or_endpoint():  # type: ignore[no-untyped-def]
    assert gpu_agent.report_url("http://cp:8000") == "http://cp:8000/api/v1/gpu-reports/"
    assert gpu_agent.report_url("http://cp:8000/") == "http://cp:8000/api/v1/gpu-reports/"
    assert (gpu_agent.report_url("https://cp/api/v1/gpu-reports")
            == "https://cp/api/v1/gpu-reports/")


class _Flaky(BaseHTTPRequestHandler):
    answers: list[int] = []
    seen: list[tuple[str, dict]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.headers["Authorization"], body))
        code = type(self).answers.pop(0)
        payload = json.dumps({"health": "healthy"} if code == 201 else {"detail": "x"}).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def flaky():  # type: ignore[no-untyped-def]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Flaky.seen = []
    yield server
    server.shutdown()
    server.server_close()


def test_post_retries_5xx_and_429_with_backoff(flaky):  # type: ignore[no-untyped-def]
    _Flaky.answers = [503, 429, 201]
    delays: list[float] = []
    url = f"http://127.0.0.1:{flaky.server_port}/api/v1/gpu-reports/"
    answer = gpu_agent.post_report(url, "tok", {"node": "n1"}, sleep=delays.append)
    assert answer == {"health": "healthy"}
    assert delays == [1.0, 2.0]
    assert [auth for auth, _ in _Flaky.seen] == ["Bearer tok"] * 3


def test_post_does_not_retry_a_400_and_gives_up_after_attempts(flaky):  # type: ignore[no-untyped-def]
    url = f"http://127.0.0.1:{flaky.server_port}/"
    _Flaky.answers = [400]
    with pytest.raises(gpu_agent.ReportRefused) as refused:
        gpu_agent.post_report(url, "tok", {}, sleep=lambda s: None)
    assert refused.value.status == 400 and len(_Flaky.seen) == 1
    _Flaky.answers = [500] * 3
    delays: list[float] = []
    with pytest.raises(gpu_agent.ReportRefused) as refused:
        gpu_agent.post_report(url, "tok", {}, attempts=3, sleep=delays.append)
    assert refused.value.status == 500 and delays == [1.0, 2.0]


def test_unreachable_api_is_retried_then_refused():  # type: ignore[no-untyped-def]
    delays: list[float] = []
    with pytest.raises(gpu_agent.ReportRefused) as refused:
        gpu_agent.post_report("http://127.0.0.1:9/", "tok", {}, attempts=3, timeout_s=1,
                              sleep=delays.append)
    assert "unreachable after 3 attempts" in str(refused.value) and delays == [1.0, 2.0]
