"""Local regions in Linux network namespaces: real kernel delay and partitions, for the lab's
end-to-end tests and benchmarks.

Each `Region` is a namespace joined to the root namespace by a veth pair with a /30 of its
own (10.213.0.0/16). Its delay is real kernel `tc netem` delay on both ends of the pair, the
lab relay's figure (`regions.geo.one_way_ms`: 4.9 µs per km one way). A partition drops every
packet and sends no reset: `netem loss 100%` where the kernel has netem, else the namespace's
end of the pair is set down with permanent neighbour entries on both sides, so nothing
answers and nothing is refused (the veth drops what it cannot deliver; no ARP failure turns
into an ICMP error). `heal()` undoes either.

What is made is named after the test process's pid (namespaces `mrdnet-<pid>-<n>`, links
`mrn<pid hex><n>a/b`), and removed three ways: at `close()`; by a watchdog, a process in a
session of its own that reads a pipe from the test process and removes everything of that
pid when the pipe closes (the test process died, however) or after `WATCHDOG_MAX_S`; and by
`sweep_stale()` at the next fixture start, for the things of pids that no longer run.

`why_unavailable()` says why namespaces cannot be made here (not root, no `ip`, a kernel
without network namespaces or veth), or None; `netem_missing()` likewise for netem. The
lab's default stays the Python relay (`controlplane/provisioning/netem.py`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from controlplane.provisioning.local_processes import pid_alive

ROOT = Path(__file__).resolve().parents[2]
NS_PREFIX = "mrdnet-"
LINK_PREFIX = "mrn"
WATCHDOG_MAX_S = 1800.0
_NS_RE = re.compile(r"^mrdnet-(\d+)-\d+$")
_LINK_RE = re.compile(r"^mrn([0-9a-f]{6})\d+[ab]$")


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=timeout)



_availability: dict[str, str | None] = {}


def why_unavailable() -> str | None:
    """None where namespaces and veth pairs can be made; else why not."""
    if "ns" in _availability:
        return _availability["ns"]
    reason: str | None = None
    if os.geteuid() == 0 and shutil.which("ip") is None:
        # As make setup does; it never fails, and says why where it cannot install.
        subprocess.run(["sh", str(ROOT / "tools" / "ensure_iproute2.sh")], timeout=600,
                       check=False)
    if os.geteuid() != 0:
        reason = "network namespaces need root"
    elif shutil.which("ip") is None:
        reason = "no `ip` command (Debian's iproute2; tools/ensure_iproute2.sh installs it)"
    else:
        probe = f"{NS_PREFIX}{os.getpid()}-999"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            reason = f"cannot make a network namespace: {made.stderr.strip()}"
        else:
            a, b = f"{LINK_PREFIX}{os.getpid():06x}9a", f"{LINK_PREFIX}{os.getpid():06x}9b"
            veth = _ip("link", "add", a, "type", "veth", "peer", "name", b, check=False)
            if veth.returncode != 0:
                reason = f"cannot make a veth pair: {veth.stderr.strip()}"
            _ip("link", "del", a, check=False)
            _ip("netns", "del", probe, check=False)
    _availability["ns"] = reason
    return reason


def netem_missing() -> str | None:
    """None where `tc qdisc ... netem` works on a veth; else why not."""
    if "netem" in _availability:
        return _availability["netem"]
    reason = why_unavailable()
    if reason is None:
        if shutil.which("tc") is None:
            reason = "no `tc` command (iproute2)"
        else:
            a, b = f"{LINK_PREFIX}{os.getpid():06x}8a", f"{LINK_PREFIX}{os.getpid():06x}8b"
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            try:
                tc = subprocess.run(["tc", "qdisc", "add", "dev", a, "root", "netem",
                                     "delay", "1ms"], capture_output=True, text=True, timeout=10)
                if tc.returncode != 0:
                    reason = f"this kernel has no tc netem ({tc.stderr.strip()})"
            finally:
                _ip("link", "del", a, check=False)
    _availability["netem"] = reason
    return reason


def sweep_stale() -> list[str]:
    """Remove namespaces and links left by test processes that no longer run."""
    removed = []
    for name in _ip("netns", "list", check=False).stdout.split():
        match = _NS_RE.match(name)
        if match and not pid_alive(int(match.group(1))):
            _remove_namespace(name)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        fields = line.split(":", 2)
        if len(fields) < 2:
            continue
        name = fields[1].strip().split("@")[0]
        match = _LINK_RE.match(name)
        if match and not pid_alive(int(match.group(1), 16)):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _remove_namespace(name: str) -> None:
    """Kill what runs inside (a namespace outlives its name while processes hold it), then
    delete it; its end of a veth pair goes with it, and so does the other end."""
    for text in _ip("netns", "pids", name, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(text), 9)
    _ip("netns", "del", name, check=False)


def remove_all_of(pid: int) -> None:
    """Remove every namespace and link named after `pid`, and the processes inside."""
    for name in _ip("netns", "list", check=False).stdout.split():
        if name.startswith(f"{NS_PREFIX}{pid}-"):
            _remove_namespace(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        fields = line.split(":", 2)
        if len(fields) >= 2:
            name = fields[1].strip().split("@")[0]
            if name.startswith(f"{LINK_PREFIX}{pid:06x}"):
                _ip("link", "del", name, check=False)


class Region:
    """One namespace and its veth pair; the namespace's address is `address`."""

    def __init__(self, lab: Lab, index: int, one_way_ms: float) -> None:
        self.lab = lab
        self.name = f"{NS_PREFIX}{lab.pid}-{index}"
        self.outer = f"{LINK_PREFIX}{lab.pid:06x}{index}a"
        self.inner = f"{LINK_PREFIX}{lab.pid:06x}{index}b"
        slot = (lab.pid * 8 + index) % 16384
        base = slot * 4
        self.gateway = f"10.213.{base >> 8}.{(base & 255) + 1}"
        self.address = f"10.213.{base >> 8}.{(base & 255) + 2}"
        self.one_way_ms = one_way_ms
        self.partitioned = False

    def make(self) -> None:
        _ip("netns", "add", self.name)
        _ip("link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
        _ip("link", "set", self.inner, "netns", self.name)
        _ip("addr", "add", f"{self.gateway}/30", "dev", self.outer)
        _ip("link", "set", self.outer, "up")
        _ip("-n", self.name, "addr", "add", f"{self.address}/30", "dev", self.inner)
        _ip("-n", self.name, "link", "set", self.inner, "up")
        _ip("-n", self.name, "link", "set", "lo", "up")
        outer_mac = Path(f"/sys/class/net/{self.outer}/address").read_text().strip()
        inner_mac = self.exec(["cat", f"/sys/class/net/{self.inner}/address"]).stdout.strip()
        # Permanent neighbours: a partition never turns into an ARP failure's ICMP error.
        _ip("neigh", "replace", self.address, "lladdr", inner_mac, "dev", self.outer,
            "nud", "permanent")
        _ip("-n", self.name, "neigh", "replace", self.gateway, "lladdr", outer_mac, "dev",
            self.inner, "nud", "permanent")
        if self.lab.netem:
            self._netem("add", loss=False)

    def exec(self, argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.name, *argv], capture_output=True,
                              text=True, check=True, timeout=30, **kwargs)  # type: ignore[call-overload]

    def popen(self, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """A process inside the namespace (ended with the namespace at the latest)."""
        return subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **kwargs)  # type: ignore[call-overload]

    def _netem(self, verb: str, loss: bool) -> None:
        extra = ["loss", "100%"] if loss else []
        delay = [f"{self.one_way_ms:.3f}ms"]
        subprocess.run(["tc", "qdisc", verb, "dev", self.outer, "root", "netem", "delay",
                        *delay, *extra], check=True, capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "exec", self.name, "tc", "qdisc", verb, "dev",
                        self.inner, "root", "netem", "delay", *delay, *extra],
                       check=True, capture_output=True, timeout=10)

    def partition(self) -> None:
        """Drop every packet both ways; nothing is refused or reset."""
        if self.lab.netem:
            self._netem("change", loss=True)
        else:
            _ip("-n", self.name, "link", "set", self.inner, "down")
        self.partitioned = True

    def heal(self) -> None:
        if self.lab.netem:
            self._netem("change", loss=False)
        else:
            _ip("-n", self.name, "link", "set", self.inner, "up")
        self.partitioned = False


class Lab:
    """The namespaces of one test process, with a watchdog that removes them if it dies."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.netem = netem_missing() is None
        self.regions: list[Region] = []
        self.watchdog: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        sweep_stale()
        self.watchdog = subprocess.Popen(
            [sys.executable, __file__, "watch", str(self.pid), str(WATCHDOG_MAX_S)],
            stdin=subprocess.PIPE, start_new_session=True,
            cwd=ROOT)

    def region(self, one_way_ms: float = 0.0) -> Region:
        region = Region(self, len(self.regions), one_way_ms)
        self.regions.append(region)
        region.make()
        return region

    def close(self) -> None:
        remove_all_of(self.pid)
        self.regions.clear()
        if self.watchdog is not None:
            assert self.watchdog.stdin is not None
            self.watchdog.stdin.close()  # it sweeps once more and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.watchdog.wait(timeout=10)
            self.watchdog = None


@contextlib.contextmanager
def lab() -> Iterator[Lab]:
    made = Lab()
    made.start()
    try:
        yield made
    finally:
        made.close()


def _watch(pid: int, max_s: float) -> None:
    """Wait for the test process's pipe to close (or max_s), then remove what it made."""
    import select
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sys.stdin], [], [], min(5.0, deadline - time.monotonic()))
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break
    remove_all_of(pid)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "watch":
        _watch(int(sys.argv[2]), float(sys.argv[3]))
