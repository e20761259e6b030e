"""The engine model: continuous batching in steps, as vLLM's scheduler runs them.

Each step admits waiting requests while there are free sequence slots and KV room, spends
a chunked-prefill budget on uncached prompt tokens, and decodes one token for every
sequence past its prefill. A step lasts prefill tokens × prefill time plus one decode step
whose length grows with the batch, so a long uncached prefill slows every stream in the
batch, and prefix-cache hits shorten both TTFT and the steps around them. When the KV
cache overflows, the newest request is preempted and recomputed later.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from enginesim.metrics import EngineMetrics
from enginesim.prefix_cache import BLOCK, PrefixCache, block_hashes
from enginesim.profiles import Profile
from enginesim.tokens import token_text


@dataclass(eq=False)
class SimRequest:
    prompt_tokens: list[int]
    max_tokens: int
    finish_on_length: bool  # True: stop at max_tokens with "length"; else a natural "stop"
    gen_seed: int
    arrived: float = field(default_factory=time.monotonic)
    hashes: list[int] = field(default_factory=list)
    prefill_left: int = -1
    cached: int = 0
    not_before: float = 0.0
    generated: int = 0
    out: list[str] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    finished: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    aborted: bool = False

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_tokens)

    @property
    def held_tokens(self) -> int:
        return self.n_prompt + self.generated


class Engine:
    def __init__(self, profile: Profile, metrics: EngineMetrics, max_num_seqs: int | None = None,
                 kv_cache_tokens: int | None = None) -> None:
        self.profile = profile
        self.metrics = metrics
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.kv_capacity = kv_cache_tokens or profile.kv_cache_tokens
        self.cache = PrefixCache(self.kv_capacity // BLOCK)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.kv_used = 0
        self.slow_factor = 1.0
        self.paused = False
        self._wake = asyncio.Event()
        self.steps = 0

    # -- requests ---------------------------------------------------------------------------
    def submit(self, request: SimRequest) -> None:
        request.hashes = block_hashes(request.prompt_tokens)
        self.waiting.append(request)
        self.metrics.waiting.set(len(self.waiting))
        self._wake.set()

    def abort(self, request: SimRequest) -> None:
        """The client went away: free its slot at the next step."""
        request.aborted = True

    # -- the loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_step = loop.time()
        while True:
            if self.paused or (not self.running and not self.waiting):
                self._wake.clear()
                await self._wake.wait()
                next_step = loop.time()
                continue
            now = time.monotonic()
            self._admit(now)
            prefill_tokens = self._prefill()
            decoding = [r for r in self.running if r.prefill_left == 0 and now >= r.not_before]
            step = prefill_tokens * self.profile.prefill_s_per_token
            if decoding:
                step += self.profile.itl_at(len(decoding))
            step *= self.slow_factor
            if step <= 0 and not decoding:
                # Only requests still in their fixed overhead: sleep until the first is due.
                due = min((r.not_before for r in self.running if r.prefill_left == 0),
                          default=now + 0.001)
                await asyncio.sleep(max(due - now, 0.0005))
                next_step = loop.time()
                continue
            next_step = max(next_step + step, loop.time() - 0.05)
            delay = next_step - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            self._emit(decoding)
            self._relieve_kv_pressure()
            self._update_gauges()
            self.steps += 1

    def _admit(self, now: float) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.aborted:
                self.waiting.popleft()
                continue
            if self.running and self.kv_used + request.held_tokens > self.kv_capacity:
                break
            self.waiting.popleft()
            first_admission = request.prefill_left < 0
            # vLLM always recomputes at least the last prompt token.
            cached = min(self.cache.cached_tokens(request.hashes), max(request.n_prompt - 1, 0))
            if first_admission:
                self.metrics.prefix_queries.inc(request.n_prompt)
                self.metrics.prefix_hits.inc(cached)
                request.cached = cached
                request.not_before = now + self.profile.overhead_s * self.slow_factor
            request.prefill_left = request.held_tokens - cached
            self.running.append(request)
            self.kv_used += request.held_tokens
        self.cache.shrink(max(self.kv_capacity - self.kv_used, 0) // BLOCK)

    def _prefill(self) -> int:
        budget = self.profile.prefill_chunk_tokens
        spent = 0
        for request in self.running:
            if budget <= 0:
                break
            if request.prefill_left > 0:
                take = min(request.prefill_left, budget)
                request.prefill_left -= take
                budget -= take
                spent += take
                if request.prefill_left == 0:
                    self.cache.insert(request.hashes)
                    self.metrics.prompt_tokens.inc(request.n_prompt)
        return spent

    def _emit(self, decoding: list[SimRequest]) -> None:
        now = time.monotonic()
        finished = []
        for request in decoding:
            if request.aborted:
                finished.append(request)
                request.finished = "abort"
                continue
            request.out.append(token_text(request.gen_seed, request.generated))
            request.generated += 1
            self.kv_used += 1
            if request.first_token_at is None:
                request.first_token_at = now
                self.metrics.ttft.observe(now - request.arrived)
            else:
                self.metrics.itl.observe(now - (request.last_token_at or now))
            request.last_token_at = now
            if request.generated >= request.max_tokens:
                request.finished = "length" if request.finish_on_length else "stop"
                finished.append(request)
            request.event.set()
        self.metrics.generation_tokens.inc(sum(1 for r in decoding if not r.aborted))
        for request in self.running:
            if request.aborted and request not in decoding and request.finished is None:
                request.finished = "abort"
                finished.append(request)
        for request in finished:
            self.running.remove(request)
            self.kv_used -= request.held_tokens
            self.metrics.success[request.finished or "abort"].inc()
            self.metrics.e2e.observe(now - request.arrived)
            request.event.set()

    def _relieve_kv_pressure(self) -> None:
        while self.kv_used > self.kv_capacity and len(self.running) > 1:
            victim = self.running.pop()
            self.kv_used -= victim.held_tokens
            victim.prefill_left = victim.held_tokens  # recomputed when readmitted
            self.waiting.appendleft(victim)
            self.metrics.preemptions.inc()

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.kv_usage.set(min(self.kv_used / self.kv_capacity, 1.0))
