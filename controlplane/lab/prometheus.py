"""Prometheus in the lab, when its binary is installed: the shipped config and its rules,
copied beside the target files the control plane writes, the command line to run it, and the
start itself."""

from __future__ import annotations

import shutil
import socket
import urllib.request
from collections.abc import Callable
from pathlib import Path

from controlplane.lab.processes import ProcessGroup
from controlplane.lab.waiting import WaitTimeout, wait_until

CONFIG = Path(__file__).resolve().parents[2] / "infra" / "prometheus" / "prometheus.yml"
# Recording and alerting rules, which the config names as rules/*.yml beside itself.
RULES = CONFIG.parent / "rules"


def prometheus_argv(var_dir: Path, listen: str, binary: str | None = None) -> list[str] | None:
    """The command that runs Prometheus over `var_dir/prometheus`, or None when there is no
    `prometheus` on PATH (telemetry then scrapes replicas itself)."""
    binary = binary or shutil.which("prometheus")
    if not binary:
        return None
    home = (var_dir / "prometheus").resolve()
    (home / "targets").mkdir(parents=True, exist_ok=True)
    config = home / "prometheus.yml"
    shutil.copyfile(CONFIG, config)
    shutil.rmtree(home / "rules", ignore_errors=True)
    shutil.copytree(RULES, home / "rules", ignore=shutil.ignore_patterns("tests"))
    return [binary, f"--config.file={config}", f"--storage.tsdb.path={home / 'data'}",
            "--storage.tsdb.retention.time=2d", f"--web.listen-address={listen}"]


def start_prometheus(group: ProcessGroup, var_dir: Path, host: str, port: int,
                     say: Callable[[str], None] = print, ready_s: float = 30.0) -> str | None:
    """Start Prometheus as one of the group's children and return its URL once it is ready;
    None (and nothing left running) when it is not installed or does not become ready. A busy
    `port` (another Prometheus, another lab) gives way to a free one."""
    if shutil.which("prometheus") is None:
        return None
    if not port_free(host, port):
        busy, port = port, free_port(host)
        say(f"  Prometheus: port {busy} is taken; using {port}")
    argv = prometheus_argv(var_dir, f"{host}:{port}")
    if argv is None:
        return None
    child = group.start("prometheus", argv)
    url = f"http://{host}:{port}"
    if wait_ready(url, ready_s, lambda: child.process.poll() is None):
        return url
    child.process.kill()
    child.process.wait(5)
    group.children.remove(child)
    say(f"  Prometheus did not become ready; see {child.log_path}")
    return None


def wait_ready(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Whether Prometheus at `url` answers /-/ready within the time (False as soon as `alive`
    is: a process that exited will not become ready)."""
    try:
        wait_until(lambda: not alive() or _ready(url), timeout_s, f"Prometheus ready at {url}",
                   every_s=0.1, ignore=(OSError,))
    except WaitTimeout:
        return False
    return alive()


def _ready(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as response:
        return bool(response.status == 200)


def port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
