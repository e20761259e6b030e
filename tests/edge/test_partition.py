"""A partition, not a crash: one of two replicas sits in a network namespace (controlplane/lab/netns.py)
that starts dropping every packet under load, with no reset. The edge finds out by its own
timeouts — connect timeout for new connections, the kernel's dead-peer timeout
(`dead_peer_timeout_s`: TCP keepalive and user timeout) for connections already open —
ejects the replica and sends what had not started streaming to the other one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.lab import netns
from controlplane.lab.processes import die_with_parent
from controlplane.lab.waiting import wait_until_async
from regions.geo import one_way_ms

from .conftest import TableFactory, replica
from .helpers import free_port, running_edge

ROOT = Path(__file__).resolve().parents[2]
FAR_KM = 1000.0  # Frankfurt to London, about


def _enginesim(argv_prefix: list[str], host: str, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*argv_prefix, sys.executable, "-m", "enginesim", "--host", host, "--port", str(port),
         "--model", "sim"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.DEVNULL, preexec_fn=die_with_parent())


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/health", timeout=1).read()
        return True
    except OSError:
        return False


@dataclass
class Outcome:
    started: bool = False  # the client had the answer's head (a stream under way)
    replica: str = ""  # whose head it had (a resumed stream keeps its first replica's)
    ended_at: float = 0.0
    done: bool = False  # the whole stream, through data: [DONE]
    error: str = ""


def test_a_partitioned_replica_is_ejected_and_no_unstarted_request_fails(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory,
        netns_lab: netns.Lab) -> None:
    region = netns_lab.region(one_way_ms(FAR_KM))
    far_port, near_port = free_port(), free_port()
    far_url, near_url = f"http://{region.address}:{far_port}", f"http://127.0.0.1:{near_port}"
    far = _enginesim(["ip", "netns", "exec", region.name], region.address, far_port)
    near = _enginesim([], "127.0.0.1", near_port)
    outcomes: list[Outcome] = []
    try:
        async def scenario() -> None:
            await wait_until_async(lambda: _answers(far_url) and _answers(near_url), 60,
                                   "both engines answering")
            table = make_table(models={"sim": [replica("far", far_url, rtt_ms=10),
                                               replica("near", near_url, rtt_ms=1)]},
                               policy={"scorers": {"load": 1.0}, "retry_before_first_byte": 2,
                                       "eject_after_failures": 2, "eject_base_s": 10.0})
            async with running_edge(signing_key, state_dir, connect_timeout_s=1.0,
                                    dead_peer_timeout_s=2.0, upstream_timeout_s=60.0) as edge:
                assert (await edge.push(table, signing_key))[0] == 200
                stop = asyncio.Event()

                async def one(i: int) -> None:
                    outcome = Outcome()
                    outcomes.append(outcome)
                    try:
                        response = await edge.chat("sim", f"question {i}", stream=True,
                                                   max_tokens=48)
                        if response.status != 200:
                            outcome.error = f"status {response.status}: {await response.text()}"
                            return
                        outcome.started = True
                        outcome.replica = response.headers.get("x-meridian-replica", "")
                        body = b""
                        async for chunk in response.content.iter_any():
                            body += chunk
                        outcome.done = b"data: [DONE]" in body and b'"error"' not in body
                        if not outcome.done:
                            outcome.error = f"stream ended short: {body[-200:]!r}"
                    except Exception as exc:  # noqa: BLE001 - every failure is an outcome
                        outcome.error = f"{type(exc).__name__}: {exc}"
                    finally:
                        outcome.ended_at = time.monotonic()

                async def client(worker: int) -> None:
                    i = 0
                    while not stop.is_set():
                        await one(worker * 1000 + i)
                        i += 1

                workers = [asyncio.ensure_future(client(w)) for w in range(6)]
                stats = edge.edge.stats
                # Partitioned with streams of the far replica under way, and more waiting.
                await wait_until_async(lambda: "far" in stats and stats["far"].inflight >= 2
                                       and any(o.replica == "far" and not o.done
                                               for o in outcomes), 30,
                                       "two streams under way on the far replica")
                region.partition()
                cut_at = time.monotonic()
                await wait_until_async(lambda: stats["far"].ejected(time.monotonic()), 60,
                                       "the partitioned replica ejected")
                ejected_after = time.monotonic() - cut_at
                # Load goes on past the ejection: later requests find the other replica.
                settled = len(outcomes)
                await wait_until_async(lambda: sum(o.done for o in outcomes[settled:]) >= 12,
                                       60, "12 requests done after the ejection")
                stop.set()
                await asyncio.wait_for(asyncio.gather(*workers), 90)
                cut = sum(o.started and not o.done for o in outcomes)
                caught = [o for o in outcomes if o.replica == "far" and o.ended_at > cut_at]
                print(f"\npartition → ejection: {ejected_after:.2f} s; {len(outcomes)} requests,"
                      f" {len(caught)} streams of the far replica under way at the partition, "
                      f"{sum(o.done for o in caught)} of them finished (resumed), {cut} cut, "
                      f"retries {edge.edge.metrics.retries.get(('sim',))}, "
                      f"netem {'yes' if netns_lab.netem else 'no (link down)'}")
                assert edge.edge.metrics.ejections.get(("far",)) >= 1

        asyncio.run(scenario())
    finally:
        for process in (far, near):
            process.kill()
            process.wait()
    unstarted_failures = [o.error for o in outcomes if not o.started and o.error]
    assert unstarted_failures == []
    # Every request ended: none hung on the black hole.
    assert all(o.done or o.error for o in outcomes)
