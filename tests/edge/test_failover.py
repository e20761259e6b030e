"""Engines that die or fall ill while the edge is busy: killed processes, failing health
probes, and the load figures read from /metrics."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.lab.waiting import wait_until_async

from .conftest import TableFactory, replica
from .fake_engine import Behaviour, FakeEngine
from .helpers import free_port, running_edge, start_engine_process


def test_killing_an_engine_gives_no_client_error_for_requests_not_yet_answered(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    """Requests in flight on the killed engine had sent no byte to their clients, so the edge
    retries them on the other one; later requests avoid the dead engine."""
    ports = [free_port(), free_port()]
    # The doomed engine holds what it gets until it is killed: nothing it was sent can be
    # answered first, however slowly the kill comes on a loaded machine.
    processes = [start_engine_process(ports[0], delay_s=600),
                 start_engine_process(ports[1], delay_s=0.4)]
    try:
        async def scenario() -> None:
            table = make_table(models={"m": [
                replica("doomed", f"http://127.0.0.1:{ports[0]}", rtt_ms=1),
                replica("survivor", f"http://127.0.0.1:{ports[1]}", rtt_ms=1)]},
                policy={"scorers": {"load": 1.0}, "retry_before_first_byte": 2,
                        "eject_after_failures": 1, "eject_base_s": 5.0})
            async with running_edge(signing_key, state_dir) as edge:
                assert (await edge.push(table, signing_key))[0] == 200
                inflight = [asyncio.ensure_future(edge.chat("m", f"request {i}"))
                            for i in range(8)]
                await wait_until_async(lambda: edge.edge.stats["doomed"].inflight > 0, 30,
                                       "a request in flight on the doomed engine")
                processes[0].send_signal(signal.SIGKILL)
                processes[0].wait()
                later = [await edge.chat("m", f"later {i}") for i in range(4)]
                responses = [await task for task in inflight] + later
                assert [r.status for r in responses] == [200] * 12
                assert {r.headers["x-meridian-replica"] for r in later} == {"survivor"}
                assert edge.edge.metrics.retries.get(("m",)) >= 1
                assert edge.edge.metrics.ejections.get(("doomed",)) == 1

        asyncio.run(scenario())
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_health_probes_take_a_sick_replica_out_and_bring_it_back(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        sick, well = FakeEngine("m"), FakeEngine("m")
        await sick.start()
        await well.start()
        try:
            table = make_table(models={"m": [replica("sick", sick.url, rtt_ms=1),
                                             replica("well", well.url, rtt_ms=50)]})
            async with running_edge(signing_key, state_dir, probes=True,
                                    probe_interval_s=0.05) as edge:
                assert (await edge.push(table, signing_key))[0] == 200
                sick.behaviour = Behaviour(health_status=503)
                await wait_until_async(lambda: not edge.edge.stats["sick"].probe_ok, 30,
                                       "the sick replica's probe failing")
                response = await edge.chat("m")
                assert response.headers["x-meridian-replica"] == "well"
                sick.behaviour = Behaviour()
                await wait_until_async(lambda: edge.edge.stats["sick"].probe_ok, 30,
                                       "the sick replica's probe passing again")
                assert (await edge.chat("m")).headers["x-meridian-replica"] == "sick"
        finally:
            await sick.stop()
            await well.stop()

    asyncio.run(scenario())


def test_queue_depth_and_kv_usage_come_from_the_engines_metrics(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        busy, calm = FakeEngine("m"), FakeEngine("m")
        await busy.start()
        await calm.start()
        try:
            busy.behaviour = Behaviour(waiting=30, kv_usage=0.9)
            table = make_table(models={"m": [replica("busy", busy.url, rtt_ms=1),
                                             replica("calm", calm.url, rtt_ms=20)]},
                               policy={"scorers": {"latency": 1.0, "load": 2.0}})
            async with running_edge(signing_key, state_dir, probes=True,
                                    probe_interval_s=0.05) as edge:
                assert (await edge.push(table, signing_key))[0] == 200
                await wait_until_async(lambda: edge.edge.stats["busy"].waiting == 30, 30,
                                       "the busy engine's queue probed")
                assert edge.edge.stats["busy"].kv_usage == 0.9
                assert (await edge.chat("m")).headers["x-meridian-replica"] == "calm"
        finally:
            await busy.stop()
            await calm.stop()

    asyncio.run(scenario())
