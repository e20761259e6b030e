"""SkyPilotProvider: one replica is one SkyPilot cluster running `vllm serve` (DESIGN §4).

This module holds the mapping from SkyPilot exceptions to `ProviderError` kinds
(`error_from_skypilot`) and the provider, which launches the task that `skypilot_task.py`
renders and validates and drives SkyPilot's request-ID SDK (`launch`, `api_status`, `get`,
`status`, `endpoints`, `down`, and `exec` for renewed certificates:
`skypilot_certificates.py`) with a time limit on every call. `sky` is imported lazily, and the SDK is one injectable
object, so nothing here needs a cloud account or an API server until a call is made.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from controlplane.provisioning import skypilot_certificates as certificates
from controlplane.provisioning.base import (
    Capabilities,
    OfferObservation,
    ProviderError,
    ProviderHandle,
    ProviderStatus,
    ReplicaSpec,
)
from controlplane.provisioning.skypilot_task import (
    CLUSTER_PREFIX,
    ENGINE_KEY_SECRET,
    OPTIONAL_SECRETS,
    class_names,
    cluster_name_for,
    first_line,
    render_replica_task,
    task_from_yaml,
)

T = TypeVar("T")

# Clouds the catalog is read for: SkyPilot's name -> Meridian's Cloud.name (every cloud the
# shipped catalog has offers in).
DEFAULT_CLOUDS = {name: name for name in ("aws", "gcp", "azure", "lambda", "runpod", "oci")}
# The `vllm serve` job's states (SkyPilot's JobStatus): still coming up, and ended (a server
# that ends has failed, whatever the exit code).
JOB_STARTING = ("INIT", "PENDING", "SETTING_UP")
JOB_ENDED = ("FAILED", "FAILED_SETUP", "FAILED_DRIVER", "SUCCEEDED", "CANCELLED")
# An API-server request that has not ended yet (SkyPilot's RequestStatus).
LAUNCH_ACTIVE = ("PENDING", "WAITING", "RUNNING")

_QUOTA_WORDS = ("quota", "limitexceeded", "limit exceeded", "vcpulimit", "not enough quota")
_CREDENTIAL_WORDS = ("not enabled", "sky check", "credential", "unauthorized", "access denied",
                     "authfailure", "permission denied")


# -- errors ---------------------------------------------------------------------------------

def error_from_skypilot(exc: BaseException, doing: str = "") -> ProviderError:
    """Map a SkyPilot (or transport) exception to the ProviderError kind an operator acts on."""
    if isinstance(exc, ProviderError):
        return exc
    names = class_names(exc)
    message = first_line(exc)
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
    CANCEL_POLL_S = 0.5  # how often terminate reads a cancelled launch's status
    CANCEL_MIN_TIMEOUT_S = 30.0  # for the POST of a cancel (the server queues it at once)
    # adopt_or_reap works, but it lists every cluster through the API server, so it is not
    # advertised for the every-few-seconds reconcile loop; call it at start-up instead.
    capabilities = Capabilities(spot=True, multi_node=True, network_emulation=False,
                                offers_catalog=True, adopts_after_restart=False,
                                poll_interval_s=15.0, delivers_certificates=True)

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
        that already finished stays as it ended. Asking gets at least CANCEL_MIN_TIMEOUT_S
        even where the call being cleaned up after had a shorter limit."""
        try:
            _bounded(lambda: self.sdk.api_cancel(request_id, silent=True),
                     max(self.timeout_s, self.CANCEL_MIN_TIMEOUT_S), f"cancel request {request_id}")
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
        """The replica's own engine key (else the fleet's, from api_key_env) as VLLM_API_KEY,
        and with mTLS its certificate, key and the CA as PEM text."""
        key = spec.engine_key or self.environ.get(spec.api_key_env)
        if not key:
            raise ProviderError("credentials", f"environment variable {spec.api_key_env} (the "
                                               "engine API key) is not set on the control plane")
        tls = certificates.tls_secrets(spec.tls_dir) if spec.tls_dir else []
        return [(ENGINE_KEY_SECRET, key), *tls,
                *((name, self.environ.get(name, "")) for name in OPTIONAL_SECRETS)]

    def deliver_certificate(self, handle: ProviderHandle, tls_dir: str) -> str:
        """Submit the job that writes the renewed files in `tls_dir` onto the replica's node;
        returns its job id (`certificate_job_state` follows it)."""
        cluster = handle.data.get("cluster", "")
        task = task_from_yaml(certificates.refresh_task_yaml(handle.id), self.sdk,
                              certificates.tls_secrets(tls_dir))
        return certificates.submitted_job_id(self._request(
            f"deliver certificate to {cluster}", lambda: self.sdk.exec(task, cluster_name=cluster)))

    def certificate_job_state(self, handle: ProviderHandle, job_id: str) -> str:
        cluster = handle.data.get("cluster", "")
        return certificates.job_state(self._request(
            f"job status on {cluster}", lambda: self.sdk.job_status(cluster, [int(job_id)])), job_id)

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
        launching = request in LAUNCH_ACTIVE
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
        """End a launch still in flight, then `sky.down`; a cluster already gone is fine."""
        cluster = handle.data.get("cluster", "")
        if not cluster:
            return
        request_id = handle.data.get("launch_request")
        if request_id:
            self._end_launch(request_id)
        try:
            # SkyPilot raises ClusterDoesNotExist (a ValueError) for a cluster it does not know.
            self._call_retrying(lambda: self._request(f"down {cluster}",
                                                      lambda: self.sdk.down(cluster)),
                                frozenset({"unavailable", "timeout"}))
        except ProviderError as exc:
            cause = exc.__cause__
            if cause is not None and class_names(cause) & {"ClusterDoesNotExist"}:
                return
            if "does not exist" in exc.message.lower():
                return
            raise

    def _end_launch(self, request_id: str) -> None:
        """Cancel a launch request still in flight and wait, up to `timeout_s`, until the API
        server says it has ended.

        SkyPilot's `api_cancel` is itself a request, queued behind whatever the server's
        short-request workers are doing, so its being accepted proves nothing. A `down` sent
        while the launch still runs finds no cluster (done, it seems), and the launch would
        then bring the cluster up with nobody left to take it down. So a launch that has not
        ended in time is a "timeout" error (terminate is tried again), never a silent done.
        A status that cannot be read is left to `down`, which fails the same way if the server
        does not answer.
        """
        try:
            status = self._request_status(request_id)
        except ProviderError:
            return
        if status not in LAUNCH_ACTIVE:
            return
        self._cancel(request_id)
        deadline = time.monotonic() + self.timeout_s
        while status in LAUNCH_ACTIVE and time.monotonic() < deadline:
            time.sleep(min(self.CANCEL_POLL_S, max(0.0, deadline - time.monotonic())))
            try:
                status = self._request_status(request_id)
            except ProviderError:
                continue
        if status in LAUNCH_ACTIVE:
            raise ProviderError("timeout", f"launch request {request_id} is still "
                                           f"{status.lower()} on the API server {self.timeout_s:g} s "
                                           "after it was cancelled; its cluster is taken down "
                                           "once it has ended (terminate again)")

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
