"""SkyPilotProvider: one replica is one SkyPilot cluster running `vllm serve` (DESIGN §4).

This module holds the task renderer (`render_replica_task`, from
`infra/skypilot/replica.yaml.j2`), its validator (`validate_replica_task`, SkyPilot's own
`Task.from_yaml_config`, which needs no API server), the mapping from SkyPilot exceptions
to `ProviderError` kinds (`error_from_skypilot`), and the provider, which drives
SkyPilot's request-ID SDK (`launch`, `api_status`, `get`, `status`, `endpoints`, `down`)
with a time limit on every call. `sky` is imported lazily, and the SDK is one injectable
object, so nothing here needs a cloud account or an API server until a call is made.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import threading
import time
from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import jinja2
import yaml

from controlplane.provisioning.base import (
    Capabilities,
    OfferObservation,
    ProviderError,
    ProviderHandle,
    ProviderStatus,
    ReplicaSpec,
)
from controlplane.provisioning.engine_args import kv_offload, kv_transfer_config, vllm_serve_args

T = TypeVar("T")

TEMPLATE_PATH = Path(__file__).resolve().parents[2] / "infra" / "skypilot" / "replica.yaml.j2"
CLUSTER_PREFIX = "mrd-"
RAY_PORT = 6379
# Secrets the template declares without a value; filled in at launch from os.environ.
OPTIONAL_SECRETS = ("HF_TOKEN",)
# Clouds the catalog is read for: SkyPilot's name -> Meridian's Cloud.name (every cloud the
# shipped catalog has offers in).
DEFAULT_CLOUDS = {name: name for name in ("aws", "gcp", "azure", "lambda", "runpod", "oci")}
# The `vllm serve` job's states (SkyPilot's JobStatus): still coming up, and ended (a server
# that ends has failed, whatever the exit code).
JOB_STARTING = ("INIT", "PENDING", "SETTING_UP")
JOB_ENDED = ("FAILED", "FAILED_SETUP", "FAILED_DRIVER", "SUCCEEDED", "CANCELLED")

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VERSION = re.compile(r"^[0-9]+(\.[0-9]+){1,3}([a-z0-9.+-]*)$")
_ACCELERATOR = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_QUOTA_WORDS = ("quota", "limitexceeded", "limit exceeded", "vcpulimit", "not enough quota")
_CREDENTIAL_WORDS = ("not enabled", "sky check", "credential", "unauthorized", "access denied",
                     "authfailure", "permission denied")


# -- rendering and validation ---------------------------------------------------------------

def cluster_name_for(replica_id: str) -> str:
    """`mrd-<replica_id>`, lower-cased and limited to what every cloud accepts."""
    tail = re.sub(r"[^a-z0-9-]+", "-", replica_id.lower()).strip("-") or "replica"
    return (CLUSTER_PREFIX + tail)[:40].rstrip("-")


@lru_cache(maxsize=1)
def _template() -> jinja2.Template:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_PATH.parent)),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
        keep_trailing_newline=True, autoescape=False,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env.get_template(TEMPLATE_PATH.name)


def check_spec(spec: ReplicaSpec) -> None:
    """Refuse specs no SkyPilot task or vLLM server could honour, naming the field."""
    problems = []
    if not spec.cloud or not re.fullmatch(r"[a-z0-9-]+", spec.cloud):
        problems.append(f"cloud {spec.cloud!r} is not a SkyPilot cloud name")
    if not spec.region or not re.fullmatch(r"[A-Za-z0-9_.-]+", spec.region):
        problems.append(f"region {spec.region!r} is not a region code")
    if not _ACCELERATOR.fullmatch(spec.accelerator or ""):
        problems.append(f"accelerator {spec.accelerator!r} is not an accelerator name")
    for field in ("gpus_per_node", "nodes", "tensor_parallel", "pipeline_parallel",
                  "max_model_len", "disk_gb"):
        if int(getattr(spec, field)) < 1:
            problems.append(f"{field} must be at least 1, got {getattr(spec, field)}")
    if not 1 <= spec.port <= 65535 or spec.port == RAY_PORT:
        problems.append(f"port {spec.port} is not usable for the engine")
    if not _ENV_NAME.fullmatch(spec.api_key_env or ""):
        problems.append(f"api_key_env {spec.api_key_env!r} is not an environment variable name")
    if not _VERSION.fullmatch(spec.vllm_version or ""):
        problems.append(f"vllm_version {spec.vllm_version!r} is not a pinned version")
    for key in spec.env:
        if not _ENV_NAME.fullmatch(key) or key in (spec.api_key_env, *OPTIONAL_SECRETS):
            problems.append(f"env {key!r} is not allowed (bad name, or a secret)")
    if not problems:
        world = spec.tensor_parallel * spec.pipeline_parallel
        gpus = spec.gpus_per_node * spec.nodes
        if world > gpus:
            problems.append(
                f"tensor_parallel {spec.tensor_parallel} × pipeline_parallel "
                f"{spec.pipeline_parallel} = {world} GPUs, but {spec.nodes} node(s) × "
                f"{spec.accelerator}:{spec.gpus_per_node} has {gpus}")
        if spec.nodes > 1 and spec.pipeline_parallel % spec.nodes:
            problems.append(f"pipeline_parallel {spec.pipeline_parallel} does not split evenly "
                            f"over {spec.nodes} nodes")
    if spec.engine != "vllm":
        problems.append(f"engine {spec.engine!r} runs only in local regions; a SkyPilot "
                        "replica runs vLLM")
    if spec.disaggregation and spec.kv_offload:
        problems.append("disaggregation and kv_offload each set vLLM's KV connector; "
                        "use one of them")
    if problems:
        raise ProviderError("invalid", "; ".join(problems))


def render_replica_task(spec: ReplicaSpec) -> str:
    """The SkyPilot task YAML for one replica (pure: reads only the template)."""
    check_spec(spec)
    _, extra_pips = kv_transfer_config(spec)
    offload = kv_offload(spec)
    pips = [f"vllm=={spec.vllm_version}"]
    if spec.nodes > 1:
        pips.append("ray[default]")
    if offload and offload["backend"] == "lmcache":
        pips.append("lmcache")
    pips.extend(extra_pips)
    return _template().render(
        replica_id=spec.replica_id, deployment=spec.deployment,
        cluster_name=cluster_name_for(spec.replica_id), cloud=spec.cloud, region=spec.region,
        accelerator=spec.accelerator, gpus_per_node=spec.gpus_per_node, nodes=spec.nodes,
        use_spot=spec.use_spot, disk_gb=spec.disk_gb, port=spec.port,
        vllm_version=spec.vllm_version, env=sorted(spec.env.items()),
        api_key_env=spec.api_key_env, pip_packages=pips, ray_port=RAY_PORT, model=spec.model,
        vllm_args=vllm_serve_args(spec, "0.0.0.0", spec.port),
    )


def _load_yaml(yaml_text: str) -> dict[str, Any]:
    try:
        config = yaml.safe_load(yaml_text)
    except yaml.YAMLError as exc:
        raise ProviderError("invalid", f"task is not valid YAML: {exc}") from exc
    if not isinstance(config, dict):
        raise ProviderError("invalid", "task YAML is not a mapping")
    return config


def task_from_yaml(yaml_text: str, sdk: Any = None,
                   secrets: Iterable[tuple[str, str]] | None = None) -> Any:
    """A `sky.Task` from YAML text; any SkyPilot complaint becomes ProviderError('invalid')."""
    config = _load_yaml(yaml_text)
    if sdk is None:
        import sky as sdk  # noqa: PLC0415 - heavy, and only needed here
    try:
        return sdk.Task.from_yaml_config(config, secrets_overrides=list(secrets or []) or None)
    except Exception as exc:  # SkyPilot raises ValueError and its own schema errors
        raise ProviderError("invalid", f"SkyPilot rejects the task: {_first_line(exc)}") from exc


def validate_replica_task(yaml_text: str) -> None:
    """Parse the YAML and build a `sky.Task` from it; raise ProviderError('invalid') if either
    fails, or if the task lost what a replica needs (cloud, region, accelerators, ports)."""
    task = task_from_yaml(yaml_text)
    resources = list(task.resources)
    if len(resources) != 1:
        raise ProviderError("invalid", f"a replica task has one resources entry, got "
                                       f"{len(resources)}")
    res = resources[0]
    missing = [name for name, value in (("cloud", res.cloud), ("region", res.region),
                                        ("accelerators", res.accelerators),
                                        ("ports", res.ports)) if not value]
    if missing:
        raise ProviderError("invalid", f"task resources lack {', '.join(missing)}")
    if not task.run or "vllm serve" not in str(task.run):
        raise ProviderError("invalid", "task run does not start `vllm serve`")
    _check_cloud_features(task, res)


# What a replica may ask of a cloud, in the words an operator would use.
_FEATURE_WORDS = {
    "spot_instance": "spot instances (use_spot)",
    "multi-node": "multi-node clusters (pipeline parallelism over nodes)",
    "open_ports": "opening the engine's port",
}


def _check_cloud_features(task: Any, res: Any) -> None:
    """Refuse what the cloud cannot do at all (Lambda has no spot, RunPod no multi-node), as
    SkyPilot's own per-cloud feature table says, before a launch finds out the slow way."""
    from sky.clouds import CloudImplementationFeatures as Feature  # noqa: PLC0415

    wanted = []
    if res.use_spot:
        wanted.append(Feature.SPOT_INSTANCE)
    if int(task.num_nodes or 1) > 1:
        wanted.append(Feature.MULTI_NODE)
    if res.ports:
        wanted.append(Feature.OPEN_PORTS)
    refused = []
    for feature in wanted:
        try:
            res.cloud.check_features_are_supported(res, {feature}, region=res.region)
        except Exception as exc:  # NotSupportedError, with SkyPilot's table of reasons
            if "NotSupportedError" not in _class_names(exc):
                raise
            refused.append(_FEATURE_WORDS.get(feature.value, feature.value))
    if refused:
        accelerators = ",".join(f"{k}:{v}" for k, v in (res.accelerators or {}).items())
        raise ProviderError("invalid", f"{res.cloud} does not support {' or '.join(refused)} "
                                       f"(asked for {accelerators} × {task.num_nodes} node(s) "
                                       f"in {str(res.cloud).lower()}:{res.region})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # SkyPilot colours some messages
    return text.splitlines()[0][:500]


# -- errors ---------------------------------------------------------------------------------

def _class_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def error_from_skypilot(exc: BaseException, doing: str = "") -> ProviderError:
    """Map a SkyPilot (or transport) exception to the ProviderError kind an operator acts on."""
    if isinstance(exc, ProviderError):
        return exc
    names = _class_names(exc)
    message = _first_line(exc)
    texts = [str(exc)]
    for nested in list(getattr(exc, "failover_history", None) or []) + list(
            getattr(exc, "reasons", None) or []):
        texts.append(f"{type(nested).__name__}: {nested}")
    blob = " ".join(texts).lower()
    prefix = f"{doing}: " if doing else ""
    credential_classes = {"InvalidCloudCredentials", "CloudUserIdentityError",
                          "NoCloudAccessError", "InvalidCloudConfigs",
                          "ApiServerAuthenticationError", "PermissionDeniedError",
                          "ClusterOwnerIdentityMismatchError"}
    if names & credential_classes:
        kind = "credentials"
    elif names & {"ResourcesUnavailableError", "ProvisionPrechecksError"}:
        if any(word in blob for word in _QUOTA_WORDS):
            kind = "quota"
        elif any(word in blob for word in _CREDENTIAL_WORDS):
            kind = "credentials"
        else:
            kind = "no_capacity"
    elif names & {"TimeoutError", "Timeout", "ReadTimeout", "ConnectTimeout"}:
        kind = "timeout"
    elif names & {"ApiServerConnectionError", "ServerTemporarilyUnavailableError",
                  "NetworkError", "ConnectionError", "KubeAPIUnreachableError",
                  "APIVersionMismatchError"}:
        kind = "unavailable"
    elif names & {"InvalidSkyPilotConfigError", "InvalidClusterNameError",
                  "ResourcesMismatchError", "NotSupportedError", "ProvisionUnsupportedError",
                  "UserRequestRejectedByPolicy", "ValueError"}:
        kind = "invalid"
    else:
        kind = "other"
    error = ProviderError(kind, prefix + message)
    error.__cause__ = exc
    return error


def _bounded(fn: Callable[[], T], timeout_s: float, doing: str) -> T:
    """Run `fn` in a daemon thread; ProviderError('timeout') if it is not done in time.

    A call that overruns is abandoned, not killed: SkyPilot's SDK offers no cancellation of
    a blocked HTTP call, and a daemon thread does not hold the worker open.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"skypilot {doing}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ProviderError("timeout", f"{doing}: no answer from SkyPilot in {timeout_s:g} s")
    if "error" in box:
        raise error_from_skypilot(box["error"], doing)
    return box["value"]  # type: ignore[no-any-return]


# -- the provider ---------------------------------------------------------------------------

def _enum_value(value: Any) -> str:
    return str(getattr(value, "value", value) or "").upper()


class SkyPilotProvider:
    """Replicas as SkyPilot clusters named `mrd-<replica_id>`; routing stays ours."""

    name = "skypilot"
    # adopt_or_reap works, but it lists every cluster through the API server, so it is not
    # advertised for the every-few-seconds reconcile loop; call it at start-up instead.
    capabilities = Capabilities(spot=True, multi_node=True, network_emulation=False,
                                offers_catalog=True, adopts_after_restart=False,
                                poll_interval_s=15.0)

    def __init__(self, sdk: Any = None, timeout_s: float = 60.0,
                 clouds: dict[str, str] | None = None, gpus: Iterable[str] | None = None,
                 environ: dict[str, str] | None = None, retries: int = 2,
                 retry_backoff_s: float = 0.5) -> None:
        self._sdk = sdk
        self.timeout_s = timeout_s
        self.clouds = dict(clouds or DEFAULT_CLOUDS)
        self.gpus = set(gpus) if gpus is not None else None
        self.environ = environ if environ is not None else os.environ
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s

    @property
    def sdk(self) -> Any:
        if self._sdk is None:
            import sky  # noqa: PLC0415 - slow to import; only when a call is made

            self._sdk = sky
        return self._sdk

    def _call(self, doing: str, fn: Callable[[], T]) -> T:
        return _bounded(fn, self.timeout_s, doing)

    def _request(self, doing: str, submit: Callable[[], Any], wait: bool = True) -> Any:
        """Submit one API-server request (`submit` returns its request id) and, with `wait`,
        its result from `sky.get`, all within `timeout_s`; without `wait`, the request id.

        A request that overruns is cancelled on the API server (`sky.api_cancel`), so nothing
        goes on running there that no one waits for: at once when its id is known, else as
        soon as the submission that overran returns the id.
        """
        lock = threading.Lock()
        state: dict[str, Any] = {"id": None, "abandoned": False}

        def run() -> Any:
            request_id = submit()
            with lock:
                state["id"] = request_id
                abandoned = state["abandoned"]
            if abandoned:  # the caller gave up while the server was accepting it
                self._cancel(request_id)
                return None
            return self.sdk.get(request_id) if wait else request_id

        try:
            return _bounded(run, self.timeout_s, doing)
        except ProviderError as exc:
            if exc.kind != "timeout":
                raise
            with lock:
                state["abandoned"] = True
                request_id = state["id"]
            if request_id is None:
                raise ProviderError("timeout", f"{exc.message}; the request is cancelled "
                                               "once the API server accepts it") from exc
            self._cancel(request_id)
            raise ProviderError("timeout", f"{exc.message}; request {request_id} "
                                           "cancelled") from exc

    def _cancel(self, request_id: Any) -> None:
        """Ask the API server to cancel a request (not waiting for it to be done); a request
        that already finished stays as it ended."""
        try:
            self._call(f"cancel request {request_id}",
                       lambda: self.sdk.api_cancel(request_id, silent=True))
        except ProviderError:
            pass  # best effort: the server may be the thing that is not answering

    def _call_retrying(self, attempt: Callable[[], T], kinds: frozenset[str]) -> T:
        """`attempt` (a bounded call), tried again (with backoff) after an error of one of
        `kinds`.

        Only for calls that are safe to repeat after that kind of error: `down` always is; a
        launch only after "unavailable", which means the API server never accepted it.
        """
        for tried in range(self.retries + 1):
            try:
                return attempt()
            except ProviderError as exc:
                if exc.kind not in kinds or tried == self.retries:
                    raise
            time.sleep(self.retry_backoff_s * 2 ** tried)
        raise AssertionError("unreachable: the last attempt returns or raises")

    # -- launch -----------------------------------------------------------------------------
    def _secrets(self, spec: ReplicaSpec) -> list[tuple[str, str]]:
        key = self.environ.get(spec.api_key_env)
        if not key:
            raise ProviderError("credentials", f"environment variable {spec.api_key_env} (the "
                                               "engine API key) is not set on the control plane")
        return [(spec.api_key_env, key)] + [(name, self.environ.get(name, ""))
                                            for name in OPTIONAL_SECRETS]

    def launch(self, spec: ReplicaSpec) -> ProviderHandle:
        """Submit `sky.launch` and return at once with its request id; poll() follows it."""
        yaml_text = render_replica_task(spec)
        task = task_from_yaml(yaml_text, self.sdk, self._secrets(spec))
        cluster = cluster_name_for(spec.replica_id)
        request_id = self._call_retrying(lambda: self._request(
            f"launch {cluster}", lambda: self.sdk.launch(
                task, cluster_name=cluster, retry_until_up=False, down=False), wait=False),
            frozenset({"unavailable"}))
        data = {"cluster": cluster, "launch_request": str(request_id), "port": spec.port,
                "cloud": spec.cloud, "region": spec.region, "spot": spec.use_spot}
        return ProviderHandle(self.name, spec.replica_id, data)

    # -- poll -------------------------------------------------------------------------------
    def _request_status(self, request_id: str) -> str:
        payloads = self._call("check launch request",
                              lambda: self.sdk.api_status(request_ids=[request_id]))
        for payload in payloads or []:
            status = payload.get("status") if isinstance(payload, dict) else getattr(
                payload, "status", None)
            return _enum_value(status)
        return ""

    def _cluster(self, cluster: str) -> Any | None:
        # AUTO refreshes spot clusters from the cloud, so a preemption shows up here. A
        # cluster SkyPilot does not know is left out of the list (no error).
        records = self._request(f"status {cluster}", lambda: self.sdk.status(
            cluster_names=[cluster], refresh=self.sdk.StatusRefreshMode.AUTO)) or []
        for record in records:
            name = record.get("name") if isinstance(record, dict) else getattr(record, "name", "")
            if name == cluster:
                return record
        return None

    @staticmethod
    def _field(record: Any, name: str) -> Any:
        return record.get(name) if isinstance(record, dict) else getattr(record, name, None)

    def poll(self, handle: ProviderHandle) -> ProviderStatus:
        """provisioning while `sky.launch` runs, running once it succeeded and the cluster is
        UP, failed when the launch failed (with the mapped kind) or the cluster broke,
        terminated when the cluster is gone; unknown when SkyPilot cannot be asked."""
        cluster = handle.data.get("cluster", "")
        request_id = handle.data.get("launch_request", "")
        if not cluster:
            return ProviderStatus("terminated", "handle names no cluster")
        try:
            request = self._request_status(request_id) if request_id else "SUCCEEDED"
            if request in ("FAILED", "CANCELLED"):
                return self._failed_launch(request_id, request)
            record = self._cluster(cluster)
        except ProviderError as exc:
            return ProviderStatus("unknown", str(exc))
        launching = request in ("PENDING", "WAITING", "RUNNING")
        if record is None:
            if launching:
                return ProviderStatus("provisioning", f"sky.launch {request.lower()}")
            return ProviderStatus("terminated", f"cluster {cluster} does not exist")
        status = _enum_value(self._field(record, "status"))
        if status == "UP":
            if launching:
                return ProviderStatus("starting", f"cluster {cluster} is up; launch finishing")
            return self._serving(cluster, request_id)
        if status == "INIT":
            if launching:
                return ProviderStatus("provisioning", f"cluster {cluster} is provisioning")
            reason = self._field(record, "init_status_reason") or "abnormal state"
            if self._field(record, "init_kind") == "unhealthy":
                return ProviderStatus("failed", f"cluster {cluster} is unhealthy: {reason}")
            return ProviderStatus("starting", f"cluster {cluster} is initialising: {reason}")
        if status == "STOPPED":
            return ProviderStatus("failed", f"cluster {cluster} stopped (preempted or stopped "
                                            "outside Meridian)")
        return ProviderStatus("unknown", f"cluster {cluster} reports {status or 'nothing'}")

    def _serving(self, cluster: str, request_id: str) -> ProviderStatus:
        """On an UP cluster, the state of the `vllm serve` job the launch submitted: a server
        that ended (a wrong model id, out of memory, a gated model without a token) makes a
        failed replica, not one that stays "starting" until the ready timeout."""
        try:
            job_id = None
            if request_id:  # (job_id, handle) once the launch succeeded
                launched = self._call("launch result", lambda: self.sdk.get(request_id))
                if isinstance(launched, tuple | list) and launched:
                    job_id = launched[0]
            wanted = [job_id] if job_id is not None else None  # None: the latest job
            statuses = self._request(f"job status on {cluster}",
                                     lambda: self.sdk.job_status(cluster, wanted))
        except ProviderError as exc:
            # The cluster is up; whether the engine answers is the readiness probe's to say.
            return ProviderStatus("running", f"cluster {cluster} is up (job state unknown: "
                                             f"{exc.message})")
        statuses = dict(statuses or {})
        state = statuses.get(job_id, statuses.get(str(job_id))) if job_id is not None else (
            list(statuses.values())[-1] if statuses else None)
        job = _enum_value(state)
        if job in JOB_ENDED:
            return ProviderStatus(
                "failed", f"vllm serve on cluster {cluster} ended ({job}); its log: "
                          f"sky logs {cluster} {job_id if job_id is not None else ''}".rstrip(),
                error_kind="other")
        if job in JOB_STARTING:
            return ProviderStatus("starting", f"cluster {cluster} is up; vllm serve job "
                                              f"{job.lower()}")
        return ProviderStatus("running", f"cluster {cluster} is up, vllm serve job "
                                         f"{job.lower() or 'state unknown'}")

    def _failed_launch(self, request_id: str, request: str) -> ProviderStatus:
        if request == "CANCELLED":
            return ProviderStatus("terminated", "sky.launch was cancelled")
        try:
            self._call("launch result", lambda: self.sdk.get(request_id))
        except ProviderError as exc:
            return ProviderStatus("failed", str(exc), error_kind=exc.kind)
        return ProviderStatus("failed", "other: sky.launch failed")

    # -- endpoint ---------------------------------------------------------------------------
    def endpoint(self, handle: ProviderHandle, from_region: str | None = None) -> str | None:
        """`http://<head ip>:<port>` from `sky.endpoints`, else from the status record's handle
        (clouds see one address from every region, so `from_region` does not matter)."""
        cluster = handle.data.get("cluster", "")
        port = int(handle.data.get("port", 8000))
        try:
            found = self._request(f"endpoints {cluster}",
                                  lambda: self.sdk.endpoints(cluster, port))
        except ProviderError:
            found = None
        if found:
            url = found.get(port) or found.get(str(port)) or next(iter(found.values()))
            return url if "://" in str(url) else f"http://{url}"
        try:
            record = self._cluster(cluster)
        except ProviderError:
            return None
        head_ip = getattr(self._field(record, "handle"), "head_ip", None) if record else None
        return f"http://{head_ip}:{port}" if head_ip else None

    # -- terminate --------------------------------------------------------------------------
    def terminate(self, handle: ProviderHandle) -> None:
        """Cancel a launch still in flight, then `sky.down`; a cluster already gone is fine."""
        cluster = handle.data.get("cluster", "")
        if not cluster:
            return
        request_id = handle.data.get("launch_request")
        if request_id:
            try:
                if self._request_status(request_id) in ("PENDING", "WAITING", "RUNNING"):
                    self._request("cancel launch",
                                  lambda: self.sdk.api_cancel(request_id, silent=True))
            except ProviderError:
                pass  # down below is what releases the machines
        try:
            # SkyPilot raises ClusterDoesNotExist (a ValueError) for a cluster it does not know.
            self._call_retrying(lambda: self._request(f"down {cluster}",
                                                      lambda: self.sdk.down(cluster)),
                                frozenset({"unavailable", "timeout"}))
        except ProviderError as exc:
            cause = exc.__cause__
            if cause is not None and _class_names(cause) & {"ClusterDoesNotExist"}:
                return
            if "does not exist" in exc.message.lower():
                return
            raise

    # -- offers -----------------------------------------------------------------------------
    def observe_offers(self) -> list[OfferObservation]:
        """GPU instance types and prices per region from SkyPilot's catalog (which SkyPilot
        downloads and caches); ProviderError('unavailable') when it cannot be read."""
        def read() -> list[OfferObservation]:
            out: list[OfferObservation] = []
            for sky_cloud, our_cloud in sorted(self.clouds.items()):
                listing = self.sdk.catalog.list_accelerators(
                    gpus_only=True, clouds=sky_cloud, all_regions=True, require_price=True)
                for gpu, infos in sorted(listing.items()):
                    if self.gpus is not None and gpu not in self.gpus:
                        continue
                    out.extend(self._observations(our_cloud, gpu, infos))
            return out

        try:
            return self._call("read the SkyPilot catalog", read)
        except ProviderError as exc:
            raise ProviderError("unavailable" if exc.kind in ("other", "timeout") else exc.kind,
                                exc.message) from exc

    @staticmethod
    def _observations(cloud: str, gpu: str, infos: Iterable[Any]) -> list[OfferObservation]:
        out = []
        for info in infos:
            count = float(info.accelerator_count)
            price = float(info.price) if info.price is not None else math.nan
            if not info.instance_type or count < 1 or not count.is_integer() or not (price > 0):
                continue
            spot = info.spot_price
            spot_price = float(spot) if spot is not None and float(spot) > 0 else None
            out.append(OfferObservation(cloud, info.region, gpu, int(count), info.instance_type,
                                        price, spot_price, "skypilot-catalog"))
        return out

    # -- restart safety ---------------------------------------------------------------------
    def adopt_or_reap(self, wanted: set[str]) -> tuple[list[str], list[str]]:
        """Keep `mrd-*` clusters of wanted replica ids, `sky.down` all other `mrd-*` clusters.

        Returns (adopted, reaped) replica ids as recovered from the cluster names.
        """
        wanted_by_cluster = {cluster_name_for(rid): rid for rid in wanted}

        records = self._request("status of all clusters", lambda: self.sdk.status()) or []
        adopted, reaped = [], []
        for record in records:
            cluster = str(self._field(record, "name") or "")
            if not cluster.startswith(CLUSTER_PREFIX):
                continue  # not ours
            if cluster in wanted_by_cluster:
                adopted.append(wanted_by_cluster[cluster])
                continue
            self.terminate(ProviderHandle(self.name, cluster[len(CLUSTER_PREFIX):],
                                          {"cluster": cluster}))
            reaped.append(cluster[len(CLUSTER_PREFIX):])
        return adopted, reaped
