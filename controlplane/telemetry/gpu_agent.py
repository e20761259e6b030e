"""GPU health agent for the nodes Meridian runs on.

    python -m controlplane.telemetry.gpu_agent --api http://cp:8000 --token-file /etc/meridian/token \
        --node gpu-node-7 [--replica r-12] [--interval 15] [--once] [--print]

Reads NVML through nvidia-ml-py (`pynvml`): per GPU its index, UUID, name, memory, utilisation,
temperature, power and limit, volatile ECC counts (null where ECC is off or unsupported) and the
XID errors NVML's event API delivered since the last reading. Each reading is posted as JSON to
`/api/v1/gpu-reports/` with `Authorization: Bearer <token>`, retried with backoff; `--print`
writes it to stdout as one JSON line.

This module imports nothing from Django: GPU nodes carry only this package's code and
nvidia-ml-py. Exit status: 0 done, 1 a report was refused, 2 NVML unavailable (no driver, no
library, no GPUs), 3 the token was refused.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

REPORT_PATH = "/api/v1/gpu-reports/"
EXIT_OK, EXIT_REFUSED, EXIT_NO_NVML, EXIT_AUTH = 0, 1, 2, 3
# How long each reading waits for XID events queued by the driver; the events themselves are
# buffered by NVML between readings, so a short wait loses none.
XID_WAIT_MS = 100
MAX_EVENTS_PER_READING = 256


class NvmlUnavailable(Exception):
    """NVML cannot be used on this machine; the message says why and what to do."""


class ReportRefused(Exception):
    def __init__(self, status: int, body: str) -> None:
        self.status, self.body = status, body
        super().__init__(f"the API answered {status}: {body[:500]}")


def load_nvml() -> ModuleType:
    """Import pynvml (nvidia-ml-py) lazily, so that `--help` works anywhere."""
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable(
            "nvidia-ml-py is not installed (pip install 'nvidia-ml-py>=12.535,<14')") from exc
    return pynvml


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str
    name: str


@dataclass
class GpuSampler:
    """An initialised NVML session: devices, the XID event set, and one reading per call."""

    nvml: ModuleType
    gpus: list[_Gpu] = field(default_factory=list)
    event_set: Any = None
    xid_supported: dict[int, bool] = field(default_factory=dict)
    system: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, nvml: ModuleType) -> GpuSampler:
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(_init_failure(nvml, exc)) from exc
        sampler = cls(nvml)
        try:
            count = int(nvml.nvmlDeviceGetCount())
            if count == 0:
                raise NvmlUnavailable("NVML found no GPUs on this machine")
            for i in range(count):
                sampler.gpus.append(sampler._device(i))
            sampler.system = sampler._system()
            sampler._register_xid_events()
        except NvmlUnavailable:
            sampler.close()
            raise
        except nvml.NVMLError as exc:
            sampler.close()
            raise NvmlUnavailable(f"NVML failed while listing GPUs: {exc}") from exc
        return sampler

    def _device(self, i: int) -> _Gpu:
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
        except nvml.NVMLError_GpuIsLost:
            return _Gpu(i, None, f"unknown-gpu{i}", "unknown (lost)")
        try:
            return _Gpu(i, handle, _text(nvml.nvmlDeviceGetUUID(handle)),
                        _text(nvml.nvmlDeviceGetName(handle)))
        except nvml.NVMLError_GpuIsLost:
            return _Gpu(i, handle, f"unknown-gpu{i}", "unknown (lost)")

    def _system(self) -> dict[str, Any]:
        nvml = self.nvml
        out: dict[str, Any] = {}
        for key, fn in (("driver_version", "nvmlSystemGetDriverVersion"),
                        ("nvml_version", "nvmlSystemGetNVMLVersion"),
                        ("cuda_driver_version", "nvmlSystemGetCudaDriverVersion")):
            try:
                value = getattr(nvml, fn)()
            except (nvml.NVMLError, AttributeError):
                continue
            out[key] = value if isinstance(value, int) else _text(value)
        return out

    def _register_xid_events(self) -> None:
        nvml = self.nvml
        try:
            self.event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError:
            self.event_set = None
            self.xid_supported = {g.index: False for g in self.gpus}
            return
        for g in self.gpus:
            if g.handle is None:
                self.xid_supported[g.index] = False
                continue
            try:
                nvml.nvmlDeviceRegisterEvents(g.handle, nvml.nvmlEventTypeXidCriticalError,
                                              self.event_set)
                self.xid_supported[g.index] = True
            except nvml.NVMLError:  # NotSupported on some boards and in some containers
                self.xid_supported[g.index] = False

    def drain_xids(self, wait_ms: int = XID_WAIT_MS) -> dict[int, list[int]]:
        """XID codes per GPU index that NVML queued since the last call."""
        nvml = self.nvml
        found: dict[int, list[int]] = {}
        if self.event_set is None or not any(self.xid_supported.values()):
            return found
        timeout = wait_ms
        for _ in range(MAX_EVENTS_PER_READING):
            try:
                data = nvml.nvmlEventSetWait(self.event_set, timeout)
            except nvml.NVMLError_Timeout:
                break
            except nvml.NVMLError:
                break
            timeout = 0  # the rest are already queued
            if not int(data.eventType) & nvml.nvmlEventTypeXidCriticalError:
                continue
            try:
                index = int(nvml.nvmlDeviceGetIndex(data.device))
            except nvml.NVMLError:
                continue
            found.setdefault(index, []).append(int(data.eventData))
        return found

    def read(self, wait_ms: int = XID_WAIT_MS) -> list[dict[str, Any]]:
        xids = self.drain_xids(wait_ms)
        return [self._read_gpu(g, xids.get(g.index, [])) for g in self.gpus]

    def _read_gpu(self, g: _Gpu, xids: list[int]) -> dict[str, Any]:
        nvml = self.nvml
        errors: dict[str, str] = {}
        lost = False

        def get(name: str, fn: Any, *args: Any) -> Any:
            nonlocal lost
            if g.handle is None:
                lost = True
                return None
            try:
                return fn(g.handle, *args)
            except nvml.NVMLError_NotSupported:
                return None
            except nvml.NVMLError_GpuIsLost as exc:
                lost = True
                errors[name] = str(exc)
                return None
            except nvml.NVMLError as exc:
                errors[name] = str(exc)
                return None

        memory = get("memory", nvml.nvmlDeviceGetMemoryInfo)
        util = get("utilization", nvml.nvmlDeviceGetUtilizationRates)
        temperature = get("temperature_c", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
        power_mw = get("power_w", nvml.nvmlDeviceGetPowerUsage)
        limit_mw = get("power_limit_w", nvml.nvmlDeviceGetEnforcedPowerLimit)
        ecc_mode = get("ecc", nvml.nvmlDeviceGetEccMode)
        corrected = uncorrected = None
        if ecc_mode is not None and int(ecc_mode[0]) == 1:
            corrected = get("ecc_corrected", nvml.nvmlDeviceGetTotalEccErrors,
                            nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC)
            uncorrected = get("ecc_uncorrected", nvml.nvmlDeviceGetTotalEccErrors,
                              nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        reading: dict[str, Any] = {
            "index": g.index,
            "uuid": g.uuid,
            "name": g.name,
            "memory_total_bytes": int(memory.total) if memory is not None else None,
            "memory_used_bytes": int(memory.used) if memory is not None else None,
            "utilization_gpu_pct": float(util.gpu) if util is not None else None,
            "utilization_memory_pct": float(util.memory) if util is not None else None,
            "temperature_c": float(temperature) if temperature is not None else None,
            "power_w": round(power_mw / 1000.0, 3) if power_mw is not None else None,
            "power_limit_w": round(limit_mw / 1000.0, 3) if limit_mw is not None else None,
            "ecc_corrected": int(corrected) if corrected is not None else None,
            "ecc_uncorrected": int(uncorrected) if uncorrected is not None else None,
            "xid_supported": self.xid_supported.get(g.index, False),
            "xid_errors": xids,
            "lost": lost,
        }
        if errors:
            reading["errors"] = errors
        return reading

    def close(self) -> None:
        nvml = self.nvml
        if self.event_set is not None:
            try:
                nvml.nvmlEventSetFree(self.event_set)
            except nvml.NVMLError:
                pass
            self.event_set = None
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _init_failure(nvml: ModuleType, exc: Exception) -> str:
    if isinstance(exc, getattr(nvml, "NVMLError_LibraryNotFound", ())):
        return ("NVML library (libnvidia-ml.so.1) not found: this machine has no NVIDIA driver, "
                "or the container was started without GPU access")
    if isinstance(exc, getattr(nvml, "NVMLError_DriverNotLoaded", ())):
        return "the NVIDIA driver is not loaded (is the kernel module installed and loaded?)"
    if isinstance(exc, getattr(nvml, "NVMLError_NoPermission", ())):
        return "no permission to use NVML (the agent needs access to /dev/nvidia*)"
    return f"NVML failed to initialise: {exc}"


def build_report(sampler: GpuSampler, node: str, replica: str | None, interval_s: float,
                 wait_ms: int = XID_WAIT_MS) -> dict[str, Any]:
    report: dict[str, Any] = {
        "node": node,
        "at": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "interval_s": interval_s,
        **sampler.system,
        "gpus": sampler.read(wait_ms),
    }
    if replica is not None:
        report["replica"] = replica
    return report


def report_url(api: str) -> str:
    """The report endpoint from the control plane's base URL (or the endpoint itself)."""
    parsed = urllib.parse.urlsplit(api)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"--api must be an http(s) URL, got {api!r}")
    if parsed.path.rstrip("/").endswith("gpu-reports"):
        return api if api.endswith("/") else api + "/"
    return api.rstrip("/") + REPORT_PATH


def post_report(url: str, token: str, report: dict[str, Any], *, attempts: int = 5,
                backoff_s: float = 1.0, max_backoff_s: float = 30.0, timeout_s: float = 10.0,
                sleep: Any = time.sleep) -> dict[str, Any]:
    """POST one report; retries connection errors, 429 and 5xx with exponential backoff.

    Raises ReportRefused for any other answer (or when retries run out)."""
    body = json.dumps(report).encode()
    delay = backoff_s
    last: Exception | None = None
    for attempt in range(1, attempts + 1):
        request = urllib.request.Request(url, data=body, method="POST", headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/json",
            "Accept": "application/json", "User-Agent": "meridian-gpu-agent"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                text = response.read().decode(errors="replace")
                return json.loads(text) if text else {}
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            if exc.code != 429 and exc.code < 500:
                raise ReportRefused(exc.code, text) from exc
            last = ReportRefused(exc.code, text)
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            last = exc
        if attempt < attempts:
            print(f"gpu-agent: report failed ({last}); retrying in {delay:.1f}s", file=sys.stderr)
            sleep(delay)
            delay = min(delay * 2, max_backoff_s)
    if isinstance(last, ReportRefused):
        raise last
    raise ReportRefused(0, f"unreachable after {attempts} attempts: {last}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m controlplane.telemetry.gpu_agent",
        description="Read GPU health from NVML and report it to Meridian's control plane.")
    parser.add_argument("--api", help="control plane base URL, e.g. http://cp:8000")
    parser.add_argument("--token", help="API token (operator role); see also --token-file")
    parser.add_argument("--token-file", help="file holding the API token")
    parser.add_argument("--node", required=True, help="this node's name (unique in the fleet)")
    parser.add_argument("--replica", help="the replica this node serves, e.g. r-12")
    parser.add_argument("--interval", type=float, default=15.0, help="seconds between readings")
    parser.add_argument("--once", action="store_true", help="one reading, then exit")
    parser.add_argument("--print", dest="print_", action="store_true",
                        help="print each report as one JSON line")
    args = parser.parse_args(argv)
    if not args.api and not args.print_:
        parser.error("give --api (to report) or --print (to print), or both")
    if args.interval <= 0:
        parser.error("--interval must be positive")
    if args.api:
        try:
            args.url = report_url(args.api)
        except ValueError as exc:
            parser.error(str(exc))
        token = args.token or os.environ.get("MERIDIAN_API_TOKEN", "")
        if args.token_file:
            try:
                with open(args.token_file) as fh:
                    token = fh.read().strip()
            except OSError as exc:
                parser.error(f"--token-file: {exc}")
        if not token:
            parser.error("--api needs a token: --token, --token-file or $MERIDIAN_API_TOKEN")
        args.token_value = token
    return args


def main(argv: list[str] | None = None, *, sleep: Any = time.sleep) -> int:
    args = parse_args(argv)
    try:
        sampler = GpuSampler.open(load_nvml())
    except NvmlUnavailable as exc:
        print(f"gpu-agent: NVML is not available: {exc}", file=sys.stderr)
        return EXIT_NO_NVML
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    if not args.once:
        signal.signal(signal.SIGTERM, stop)
    status = EXIT_OK
    try:
        while True:
            started = time.monotonic()
            report = build_report(sampler, args.node, args.replica, args.interval)
            if args.print_:
                print(json.dumps(report, sort_keys=True), flush=True)
            if args.api:
                try:
                    answer = post_report(args.url, args.token_value, report, sleep=sleep)
                    if answer.get("health") == "unhealthy":
                        print(f"gpu-agent: node {args.node} is unhealthy: "
                              f"{answer.get('health_reason', '')}", file=sys.stderr)
                except ReportRefused as exc:
                    print(f"gpu-agent: {exc}", file=sys.stderr)
                    if exc.status in (401, 403):
                        return EXIT_AUTH
                    status = EXIT_REFUSED
            if args.once or stopping:
                return status
            remaining = args.interval - (time.monotonic() - started)
            if remaining > 0:
                sleep(remaining)
            if stopping:
                return status
    except KeyboardInterrupt:
        return status
    finally:
        sampler.close()


if __name__ == "__main__":
    sys.exit(main())
