"""LocalProvider: replicas as engine processes on this machine, one lab region per real one.

Each replica is an engine process (`vllm serve` where vLLM and a GPU are present, else
enginesim) on a free port, plus one netem relay process with a listening port per lab
region that delays traffic by the great-circle distance between that region and the
replica's. Processes are detached and recorded as JSON under the state directory, so a
restarted control plane re-adopts live ones and reaps the rest.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from controlplane.placement.geo import great_circle_km, one_way_ms
from controlplane.provisioning.base import (
    Capabilities,
    OfferObservation,
    ProviderError,
    ProviderHandle,
    ProviderStatus,
    ReplicaSpec,
)

# Added to every one-way delay: a relay hop and a router or two even between neighbours.
FIXED_ONE_WAY_MS = 0.25


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pid_alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    if state == "Z":
        try:
            os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
        except ChildProcessError:
            pass
        return False
    return True


def kill_group(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it outlives the grace period."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.05)


def gpu_engine_available() -> bool:
    return importlib.util.find_spec("vllm") is not None and shutil.which("nvidia-smi") is not None


class LocalProvider:
    name = "local"
    capabilities = Capabilities(spot=False, multi_node=False, network_emulation=True,
                                offers_catalog=True, adopts_after_restart=True)

    def __init__(self, state_dir: Path | str, regions: Iterable[dict[str, Any]],
                 python: str | None = None, price_usd_h: float = 0.0) -> None:
        self.state_dir = Path(state_dir)
        self.regions = {r["code"]: (float(r["latitude"]), float(r["longitude"])) for r in regions}
        self.python = python or sys.executable
        self.price_usd_h = price_usd_h

    # -- records ----------------------------------------------------------------------------
    def _record_path(self, replica_id: str) -> Path:
        return self.state_dir / f"{replica_id}.json"

    def records(self) -> list[dict[str, Any]]:
        if not self.state_dir.exists():
            return []
        out = []
        for path in sorted(self.state_dir.glob("*.json")):
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return out

    def _write_record(self, record: dict[str, Any]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self._record_path(record["replica_id"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)

    # -- the protocol -----------------------------------------------------------------------
    def engine_argv(self, spec: ReplicaSpec, port: int) -> list[str]:
        if gpu_engine_available():
            return ["vllm", "serve", spec.model, "--served-model-name", spec.served_model_name,
                    "--port", str(port), "--host", "127.0.0.1",
                    "--tensor-parallel-size", str(spec.tensor_parallel),
                    "--max-model-len", str(spec.max_model_len),
                    "--enable-prefix-caching" if spec.enable_prefix_caching
                    else "--no-enable-prefix-caching"]
        return [self.python, "-m", "enginesim", "--host", "127.0.0.1", "--port", str(port),
                "--model", spec.model, "--served-model-name", spec.served_model_name,
                "--profile", spec.engine_profile, "--max-model-len", str(spec.max_model_len)]

    def delays_from(self, region_key: str) -> dict[str, float]:
        """One-way delay (ms) from every lab region to `region_key`."""
        if region_key not in self.regions:
            raise ProviderError("invalid", f"{region_key} is not a lab region "
                                           f"(known: {', '.join(sorted(self.regions))})")
        lat, lon = self.regions[region_key]
        return {
            code: round(one_way_ms(great_circle_km(lat, lon, *where)) + FIXED_ONE_WAY_MS, 3)
            for code, where in self.regions.items()
        }

    def launch(self, spec: ReplicaSpec) -> ProviderHandle:
        region_key = f"local:{spec.region}"
        delays = self.delays_from(region_key)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        log = open(self.state_dir / f"{spec.replica_id}.log", "ab")  # noqa: SIM115
        engine = subprocess.Popen(self.engine_argv(spec, port), stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        relay_ports = {code: free_port() for code in delays}
        relay_argv = [self.python, "-m", "controlplane.provisioning.netem", "--upstream",
                      f"127.0.0.1:{port}"]
        for code, relay_port in relay_ports.items():
            relay_argv += ["--listen", f"127.0.0.1:{relay_port}={delays[code]}"]
        relay = subprocess.Popen(relay_argv, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        log.close()
        data = {
            "replica_id": spec.replica_id, "region": region_key, "pid": engine.pid,
            "relay_pid": relay.pid, "port": port, "url": f"http://127.0.0.1:{port}",
            "urls_by_region": {c: f"http://127.0.0.1:{p}" for c, p in relay_ports.items()},
            "delays_ms": delays, "served_model_name": spec.served_model_name,
            "started_at": time.time(),
        }
        self._write_record(data)
        return ProviderHandle(self.name, spec.replica_id, data)

    def poll(self, handle: ProviderHandle) -> ProviderStatus:
        pid = handle.data.get("pid")
        if not pid or not self._record_path(handle.id).exists():
            return ProviderStatus("terminated", "no local record")
        if not pid_alive(int(pid)):
            return ProviderStatus("failed", f"engine process {pid} exited")
        relay = handle.data.get("relay_pid")
        if relay and not pid_alive(int(relay)):
            return ProviderStatus("failed", f"network relay {relay} exited")
        try:
            with urllib.request.urlopen(handle.data["url"] + "/health", timeout=1.0) as response:
                if response.status == 200:
                    return ProviderStatus("running", "engine answers /health")
        except OSError as exc:
            return ProviderStatus("starting", f"engine not answering yet: {exc}")
        return ProviderStatus("starting", "engine not healthy yet")

    def endpoint(self, handle: ProviderHandle, from_region: str | None = None) -> str | None:
        if from_region is not None:
            url = handle.data.get("urls_by_region", {}).get(from_region)
            if url:
                return str(url)
        return handle.data.get("url")

    def terminate(self, handle: ProviderHandle) -> None:
        for key in ("pid", "relay_pid"):
            pid = handle.data.get(key)
            if pid:
                kill_group(int(pid))
        self._record_path(handle.id).unlink(missing_ok=True)

    def observe_offers(self) -> list[OfferObservation]:
        return [
            OfferObservation("local", code.split(":", 1)[1], "H100", 1, "enginesim",
                             self.price_usd_h, None, "lab")
            for code in self.regions
        ]

    # -- restart safety ---------------------------------------------------------------------
    def adopt_or_reap(self, wanted: set[str]) -> tuple[list[str], list[str]]:
        """Keep live processes of replicas still wanted; kill and forget all others.

        Returns (adopted, reaped) replica ids.
        """
        adopted, reaped = [], []
        for record in self.records():
            rid = record.get("replica_id", "")
            alive = pid_alive(int(record.get("pid", 0) or 0))
            if rid in wanted and alive:
                adopted.append(rid)
                continue
            self.terminate(ProviderHandle(self.name, rid, record))
            reaped.append(rid)
        return adopted, reaped
