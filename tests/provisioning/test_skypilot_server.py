"""SkyPilotProvider through SkyPilot's real SDK and a real local API server (`sky api start`),
with no cloud credentials: what the provider makes of SkyPilot's own answers, not a fake's.

- a rendered replica task's launch fails in the server with SkyPilot's NoCloudAccessError,
  which becomes error kind `credentials`, in SkyPilot's words, in the launch Operation's log;
- a cluster SkyPilot does not know: `status` leaves it out (the provider says terminated),
  `down` raises ClusterDoesNotExist (the provider's terminate is done), `endpoints` fails;
- a launch that overruns the provider's time limit is cancelled on the server
  (`sky.api_cancel`; `sky.api_status` then shows it CANCELLED), and terminate cancels a
  launch still in flight and returns only once the server says it ended.

The launches that must be cancelled are held by the admin policy until they are (never for a
fixed time): SkyPilot runs a cancel as a request of its own, queued behind the server's other
short requests, and on a loaded machine that queue has run it a minute late, after a timed
hold had ended and the launch had failed on its own. When a test fails, the server's log and
the request's own log are printed.

The server runs under a throwaway HOME on a free port, with an environment that carries no
cloud credentials, SkyPilot's catalog seeded for the few offers used (nothing is downloaded),
and an admin policy (skypilot_stall_policy.py) that holds up launches that ask for it. It is
stopped when these tests end, however they end (`sky api stop`, then its process group).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.lab.waiting import WaitTimeout, wait_until
from controlplane.provisioning.base import ProviderError, ProviderHandle
from controlplane.provisioning.skypilot import SkyPilotProvider
from controlplane.provisioning.skypilot_task import cluster_name_for

from .skypilot_stall_policy import HOLD_ENV, RELEASE_ENV, STALL_ENV
from .test_skypilot import spec

pytestmark = pytest.mark.skypilot_server

REPO_ROOT = Path(__file__).resolve().parents[2]
SKY = Path(sys.executable).with_name("sky")
ENGINE_KEY = {"MERIDIAN_ENGINE_API_KEY": "sk-engine-test"}
# What the server process may see of ours: nothing that could be a cloud credential.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "TMPDIR", "TZ")

# The replicas here are Lambda ones: whether Lambda is enabled is decided by a file under
# HOME alone (no ambient credentials such as a cloud VM's metadata server could enable it, so
# no launch can reach a real cloud), and `sky check` of it is quick.
CLOUD, REGION = "lambda", "us-east-1"
CATALOG = {
    "common/accelerators.csv": "AcceleratorName,Clouds\nH100,\"AWS, GCP, Lambda\"\n",
    "common/metadata.csv": "GPU,MemoryGB,Manufacturer\nH100,80,NVIDIA\n",
    "lambda/vms.csv": (
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,Region,GpuInfo,"
        "SpotPrice\n"
        "gpu_1x_h100_pcie,H100,1.0,26.0,200.0,2.49,us-east-1,,\n"
        "gpu_8x_h100_sxm5,H100,8.0,208.0,1800.0,23.92,us-east-1,,\n"),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _processes_of(home: Path) -> list[int]:
    """Processes started with this HOME: the server, its workers, anything it spawned."""
    marker = f"HOME={home}".encode() + b"\0"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if marker in handle.read() + b"\0":
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def _wait_gone(pids: list[int], within_s: float) -> list[int]:
    """The processes of `pids` still alive once they are all gone or `within_s` has passed."""
    def alive() -> list[int]:
        return [pid for pid in pids if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]

    with contextlib.suppress(WaitTimeout):
        wait_until(lambda: not alive(), within_s, f"processes {pids} to exit", every_s=0.1)
    return alive()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


# Run beside the tests in a session of its own: it waits for its stdin, a pipe only the test
# process holds, to close (the tests ended, or their process died however it died, SIGKILL
# included), then kills every process started under the server's HOME. SkyPilot starts its
# server in a session of its own, so nothing else would stop it after a killed test run.
WATCHDOG = """
import os, signal, sys, time
sys.stdin.buffer.read()
marker = b"HOME=" + sys.argv[1].encode() + b"\\0"
for sig in (signal.SIGTERM, signal.SIGKILL):
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if marker in handle.read() + b"\\0":
                    os.kill(int(entry), sig)
        except OSError:
            pass
    time.sleep(3)
"""


class ApiServer:
    """One `sky api start` server under its own HOME and port; `stop` is idempotent."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = _free_port()
        self.env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        self.release = home / "release-held-launches"
        self.env.update(HOME=str(home), SKYPILOT_DISABLE_USAGE_COLLECTION="1",
                        **{RELEASE_ENV: str(self.release)},
                        SKYPILOT_API_SERVER_LOCAL_PORT=str(self.port),
                        AWS_EC2_METADATA_DISABLED="true",
                        PYTHONPATH=str(REPO_ROOT))  # the admin policy is imported from here
        self.stopped = False
        self.watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(home)],
                                         stdin=subprocess.PIPE, start_new_session=True)

    def prepare(self) -> None:
        sky_dir = self.home / ".sky"
        for name, text in CATALOG.items():
            path = sky_dir / "catalogs" / "v8" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        # Only Lambda is checked for credentials (a launch runs `sky check` while no cloud
        # is enabled; all clouds take far longer).
        (sky_dir / "config.yaml").write_text(
            f"allowed_clouds: [{CLOUD}]\n"
            "admin_policy: tests.provisioning.skypilot_stall_policy.StallPolicy\n")

    def sky(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(SKY), *args], env=self.env, cwd=self.home, text=True,
                              capture_output=True, timeout=timeout, check=False)

    def start(self) -> str | None:
        """None when up, else why not (the server's own words and log, each try's). A
        server that exits while starting is started again, on another port, up to three
        times: another process may take the port between `_free_port()` and the server's
        bind (the suite runs on several workers). Each failed try is a warning in the run's
        summary, so a pass after a retry still shows why the first failed."""
        self.prepare()
        tries = []
        for _ in range(3):
            why_not = self._start_once()
            if why_not is None:
                return None
            tries.append(why_not)
            warnings.warn(f"the SkyPilot API server did not start on port {self.port}, "
                          f"started again: {why_not}", stacklevel=1)
            _wait_gone(_processes_of(self.home), 30.0)
            self.port = _free_port()
            self.env["SKYPILOT_API_SERVER_LOCAL_PORT"] = str(self.port)
        return "\n---\n".join(tries)

    def _start_once(self) -> str | None:
        try:
            done = self.sky("api", "start", timeout=120)
        except subprocess.TimeoutExpired:
            # A loaded machine: the command is slow, the server it started may not be.
            return None if self.answers_late() else "`sky api start` did not finish in 120 s"
        if done.returncode != 0 and self.answers_late():
            return None
        if done.returncode != 0:
            log = self.home / ".sky" / "api_server" / "server.log"
            tail = log.read_text()[-1500:] if log.exists() else ""
            return (f"`sky api start` exited {done.returncode}: "
                    f"{(done.stdout + done.stderr)[-1500:]}\n{tail}")
        return None

    def health(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/health",
                                        timeout=5) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def answers_late(self) -> bool:
        """`sky api start` gives up after its own 60 s, while the server it started goes on
        starting; on a loaded machine it answers later. Still starting: wait for it."""
        if not _processes_of(self.home):
            return False
        try:
            wait_until(lambda: self.health() or not _processes_of(self.home), 300,
                       "the SkyPilot API server to answer /api/health", every_s=1.0)
        except WaitTimeout:
            return False
        return self.health()

    def stop(self) -> None:
        """`sky api stop` (unless the SDK's api_stop already did), then whatever is left of
        the server's process group and of the processes started under its HOME: SIGTERM,
        then SIGKILL."""
        if self.stopped:
            return
        self.stopped = True
        self.release.touch()  # launches the admin policy still holds go on (and fail)
        if self.watchdog.stdin is not None:
            self.watchdog.stdin.close()  # it sweeps up too, once we are done here
        if _processes_of(self.home):
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                self.sky("api", "stop", timeout=60)
        pids = _processes_of(self.home)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(os.getpgid(pid), sig)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            pids = _wait_gone(pids, 5.0)
            if not pids:
                break


def server_story(home: Path, request_id: str | None = None, chars: int = 6000) -> str:
    """What the API server logged (the end of its log) and, given a request id, that
    request's own log: the evidence to read when a request ends other than expected."""
    parts = []
    sky_dir = home / ".sky" / "api_server"
    if request_id:
        for log in sorted(sky_dir.glob(f"request_logs/{request_id}*")):
            parts.append(f"--- request {request_id} ({log.name}):\n"
                         f"{log.read_text(errors='replace')[-chars:]}")
    log = sky_dir / "server.log"
    if log.exists():
        parts.append(f"--- {log}:\n{log.read_text(errors='replace')[-chars:]}")
    return "\n".join(parts) or f"(no API server logs under {sky_dir})"


@pytest.fixture(scope="module")
def api_server(tmp_path_factory: pytest.TempPathFactory,
               request: pytest.FixtureRequest) -> Iterator[ApiServer]:
    """A SkyPilot API server for this module. Module-scoped, so it stops as soon as these
    tests end; the finalizer runs on failures and Ctrl-C too, and atexit is the backstop for
    a pytest that exits without running finalizers. When a test of the module failed, the
    end of the server's log is printed before the server (and its HOME) goes."""
    server = ApiServer(tmp_path_factory.mktemp("sky-server-home"))
    atexit.register(server.stop)
    failed_before = request.session.testsfailed
    try:
        if not SKY.exists():
            pytest.skip(f"no SkyPilot API server here (no `sky` command next to {sys.executable})")
        # Where SkyPilot is installed its server must start: a failure to is a failure, never
        # a skip that a loaded machine could turn into a silent pass.
        why_not = server.start()
        if why_not is not None:
            pytest.fail(f"the SkyPilot API server did not start: {why_not}")
        yield server
    finally:
        if request.session.testsfailed > failed_before:
            print(f"\nthe SkyPilot API server's log:\n{server_story(server.home)}")
        server.stop()
        atexit.unregister(server.stop)
        assert not _processes_of(server.home), "the SkyPilot API server outlived its tests"


@pytest.fixture(scope="module")
def sky(api_server: ApiServer) -> Iterator[Any]:
    """SkyPilot's SDK in this process, pointed at the module's server (and back afterwards)."""
    keys = ("HOME", "SKYPILOT_API_SERVER_LOCAL_PORT", "SKYPILOT_DISABLE_USAGE_COLLECTION")
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update({key: api_server.env[key] for key in keys})
    import sky
    from sky.server import common as server_common

    def forget_server() -> None:  # the SDK caches the server's address per process
        server_common.get_server_url.cache_clear()
        server_common.is_api_server_local.cache_clear()

    forget_server()
    try:
        yield sky
    finally:
        with contextlib.suppress(Exception):  # `sky api stop`, from the SDK already loaded
            sky.api_stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        forget_server()


def provider(timeout_s: float = 120.0) -> SkyPilotProvider:
    """The provider under test. Its limit is a backstop for a server that never answers: a
    cold API server on a loaded machine has been seen to run a queued request a minute late."""
    return SkyPilotProvider(timeout_s=timeout_s, retry_backoff_s=0.1, environ=ENGINE_KEY)


def launch_requests(sky: Any, cluster: str) -> list[Any]:
    return [r for r in sky.api_status(cluster_name=cluster, all_status=True)
            if r.name == "sky.launch"]


# -- a launch without cloud credentials ---------------------------------------------------------

@pytest.mark.django_db
def test_a_launch_without_credentials_fails_as_credentials_in_skypilots_words(  # type: ignore[no-untyped-def]
        sky, catalog):
    from controlplane.deployments.models import Deployment, Replica
    from controlplane.deployments.models import ReplicaState as S
    from controlplane.provisioning import services
    from controlplane.provisioning.models import Operation, OperationKind
    from regions.models import Cloud, Region

    lambda_cloud = Cloud.objects.create(name=CLOUD, display_name="Lambda", skypilot_name=CLOUD)
    region = Region.objects.create(cloud=lambda_cloud, code=REGION, display_name="Virginia",
                                   latitude=38.9, longitude=-77.4, country="US",
                                   jurisdiction=catalog["us"])
    deployment = Deployment.objects.create(name="chat", served_model_name="llama-3.1-8b",
                                           model=catalog["llama8b"])
    replica = Replica.objects.create(deployment=deployment, region=region,
                                     provider="skypilot", state=S.PENDING)
    services.set_provider("skypilot", provider())
    try:
        services.launch(replica.pk)
        replica.refresh_from_db()
        assert replica.state == S.PROVISIONING, replica.last_error
        request_id = replica.provider_handle["data"]["launch_request"]
        # A cold server on a busy machine may take many seconds to run its first launch;
        # wait on the request itself (a cheap read) rather than polling the cluster too.
        (payload,) = wait_until(lambda: [r for r in sky.api_status(request_ids=[request_id])
                                         if r.status not in ("PENDING", "RUNNING")], 300.0,
                                f"launch request {request_id} to end", every_s=0.5)
        assert payload.status == "FAILED"
        assert services.check(replica.pk) == S.FAILED
    finally:
        services.set_provider("skypilot", None)
    # What SkyPilot itself says: the launch request failed with NoCloudAccessError.
    with pytest.raises(sky.exceptions.NoCloudAccessError, match="Cloud access is not set up"):
        sky.get(request_id)
    launch = Operation.objects.get(replica=replica, kind=OperationKind.LAUNCH)
    assert (launch.status, launch.error_kind) == ("failed", "credentials"), launch.log
    assert "Cloud access is not set up. Run: sky check" in launch.log
    replica.refresh_from_db()
    assert "credentials" in replica.last_error and "sky check" in replica.last_error


# -- clusters SkyPilot does not know -------------------------------------------------------------

def test_status_and_down_of_a_cluster_skypilot_does_not_know(sky) -> None:  # type: ignore[no-untyped-def]
    cluster = cluster_name_for("r-never-launched")
    # SkyPilot's answers: status leaves the cluster out, down and endpoints refuse it.
    assert sky.get(sky.status(cluster_names=[cluster],
                              refresh=sky.StatusRefreshMode.AUTO)) == []
    with pytest.raises(sky.exceptions.ClusterDoesNotExist):
        sky.get(sky.down(cluster))
    with pytest.raises(sky.exceptions.ClusterNotUpError):
        sky.get(sky.endpoints(cluster, 8000))
    # The provider's reading of them.
    sky_provider = provider()
    handle = ProviderHandle("skypilot", "r-never-launched", {"cluster": cluster, "port": 8000})
    status = sky_provider.poll(handle)
    assert status.state == "terminated" and "does not exist" in status.message
    sky_provider.terminate(handle)  # nothing to take down: done, no error
    assert sky_provider.endpoint(handle) is None
    assert sky_provider.adopt_or_reap({"r-never-launched"}) == ([], [])


# -- time limits and cancellation ----------------------------------------------------------------

def test_a_launch_that_overruns_its_time_limit_is_cancelled_on_the_server(sky) -> None:  # type: ignore[no-untyped-def]
    """The policy holds the launch 2 s in `/validate` (so `sky.launch` overruns the 0.5 s
    limit before the server hands out a request id), then holds the launch itself until it is
    cancelled: the provider cancels it as soon as the id arrives, and the server shows it
    cancelled however late its queue runs the cancel."""
    s = spec(replica_id="r-slow", cloud=CLOUD, region=REGION,
             env={STALL_ENV: "2", HOLD_ENV: "1"})
    cluster = cluster_name_for(s.replica_id)
    with pytest.raises(ProviderError) as caught:  # the limit, not the 2 s stall, ends the call
        provider(timeout_s=0.5).launch(s)
    assert caught.value.kind == "timeout"
    assert "cancelled once the API server accepts it" in caught.value.message
    requests = wait_until(lambda: [r for r in launch_requests(sky, cluster)
                                   if r.status == "CANCELLED"], 300.0,
                          f"the launch of {cluster} to show as cancelled", every_s=0.3)
    with pytest.raises(sky.exceptions.RequestCancelled):
        sky.get(requests[0].request_id)


def test_terminate_cancels_a_launch_still_running_on_the_server(sky, api_server) -> None:  # type: ignore[no-untyped-def]
    """The server holds the launch until it is cancelled, so only terminate can end it;
    terminate returns once the server says it has ended (a cancel waits in the server's
    queue of short requests, a minute on a loaded machine), and only then takes it down."""
    s = spec(replica_id="r-cancelled", cloud=CLOUD, region=REGION, env={HOLD_ENV: "1"})
    sky_provider = provider()
    handle = sky_provider.launch(s)
    request_id = handle.data["launch_request"]
    sky_provider.terminate(handle)
    (payload,) = sky.api_status(request_ids=[request_id])
    assert payload.status == "CANCELLED", (
        f"{payload.status}: {getattr(payload, 'status_msg', None)}\n"
        f"{server_story(api_server.home, request_id)}")
    status = sky_provider.poll(handle)
    assert status.state == "terminated" and "cancelled" in status.message
    sky_provider.terminate(handle)  # again: the launch is over and there is no cluster
