"""The engine loop: runs the scheduler's steps in real time and hands out their tokens.

One asyncio task plans a step, sleeps until the step's modelled end, applies it and gives
each sequence that got a token to its output (an object with `deliver(seq)`, which writes
the token to its HTTP response at once). Nothing else in the process runs per token: there
is no task or future per request per token, so one core holds hundreds of streams.

Steps are laid end to end on a fixed timeline: a step starts where the previous one ended,
not when the loop got round to it, so the time spent applying a step and writing its tokens
overlaps the next step (as a GPU keeps computing while the CPU streams) instead of adding to
every inter-token gap. A loop that was held up (its core busy with other work) makes the
time up over the next steps, so throughput stays the profile's; one held up for longer than
MAX_CATCH_UP_S restarts the timeline from now rather than release a burst of tokens. After
an idle spell or a hang the timeline starts afresh.
"""

from __future__ import annotations

import asyncio
import time

from enginesim.metrics import EngineMetrics, EngineState
from enginesim.scheduler import Scheduler, Sequence

# How late the loop may get (a busy or shared core) and still lay the next step end to end
# with the last, making the lost time up; beyond it, the timeline restarts from now.
MAX_CATCH_UP_S = 0.1


class Engine:
    def __init__(self, scheduler: Scheduler, metrics: EngineMetrics) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        scheduler.recorder = metrics
        self.slow_factor = 1.0
        self._paused = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- requests ----------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Admit `seq` (its arrival already set); it reaches the scheduler after the overhead."""
        overhead = self.scheduler.profile.overhead_s * self.slow_factor
        self.scheduler.add(seq, seq.arrival + overhead)
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        if seq.finish_reason is None:
            self.scheduler.abort(seq)
            self.metrics.record_finish(seq, time.monotonic())

    # -- faults ------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake.set()

    # -- state -------------------------------------------------------------------------------
    def state(self) -> EngineState:
        s = self.scheduler
        return EngineState(
            running=len(s.running), waiting=len(s.waiting), kv_cache_usage=s.pool.usage(),
            prefix_cache_queries=s.prefix_queries, prefix_cache_hits=s.prefix_hits,
            preemptions=s.preemptions, prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens)

    # -- the loop ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _idle(self, timeout: float | None) -> None:
        self._wake.clear()
        if timeout is None:
            await self._wake.wait()
            return
        try:
            await asyncio.wait_for(self._wake.wait(), max(timeout, 0.0))
        except TimeoutError:
            pass

    async def run(self) -> None:
        scheduler = self.scheduler
        clock = time.monotonic
        sleep = asyncio.sleep
        timeline = clock()
        while True:
            if self._paused:
                await self._idle(None)
                timeline = clock()
                continue
            now = clock()
            step = scheduler.schedule(now)
            if step is None:
                ready = scheduler.next_ready()
                await self._idle(None if ready is None else ready - now)
                timeline = clock()
                continue
            duration = step.duration * self.slow_factor
            start = timeline if now - timeline <= max(duration, MAX_CATCH_UP_S) else now
            end = start + duration
            delay = end - clock()
            await sleep(delay if delay > 0 else 0)
            while self._paused:
                await self._idle(None)
                end = clock()
            emitted = scheduler.complete(step, clock())
            for seq in emitted:
                seq.payload.deliver(seq)
            timeline = end
