"""The engine model: vLLM v1's continuous-batching scheduler, stepped on a clock it is given.

Nothing here sleeps or does I/O. `schedule(now)` plans one engine step and says how long it
takes; `complete(step, now)` applies it at the time it ends. The asyncio engine drives it in
real time; tests drive it on a virtual clock and check the timing exactly.

A request first spends the profile's fixed overhead outside the scheduler (what an API
server spends before the engine sees it), then waits in FCFS order. Each step, like vLLM's:

- schedules the running sequences first, in admission order, one token each for those
  decoding and the rest of their prompt (up to the step's token budget) for those still in
  a chunked prefill; a sequence that needs a KV block when none is free preempts the most
  recently admitted running sequence (its blocks are freed, it goes back to the front of the
  waiting queue and recomputes later), counted as a preemption;
- then, if nothing was preempted, admits waiting sequences while there are sequence slots
  (max_num_seqs), token budget (max_num_batched_tokens) and KV blocks, each starting from
  the longest cached prefix of its prompt (at most all but its last token, as vLLM);
- lasts prefill tokens × prefill time per token, plus one decode step whose length grows
  with the number of sequences decoding. A long uncached prefill therefore slows every
  decoding stream it shares steps with, and cache hits shorten both TTFT and those steps.

Prefix-cache queries and hits are counted at each admission, in tokens (a preempted
sequence is looked up again when it is readmitted), and prompt tokens when a sequence gets
its first token, as vLLM's iteration stats do.

At the end of a step every sequence whose known tokens are all computed samples one token:
the first for a sequence finishing its prefill, the next for a decoding one. For a lone
request that makes TTFT = overhead + uncached prompt tokens × prefill time per token, and
queueing adds to it under load.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from enginesim.prefix_cache import BLOCK_TOKENS, BlockPool
from enginesim.profiles import Profile


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine."""

    prompt_len: int
    block_hashes: list[int]
    max_tokens: int
    # Output length at which the model emits its end-of-sequence token; None: never.
    eos_at: int | None
    arrival: float
    # Where the engine sends this request's tokens: anything with deliver(seq).
    payload: Any = None
    ready_at: float = 0.0
    num_computed: int = 0
    num_output: int = 0
    blocks: list[int] = field(default_factory=list)
    registered: int = 0
    num_cached: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    preemptions: int = 0
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output


@dataclass(slots=True)
class Step:
    seqs: list[Sequence]
    num_new: list[int]
    prefill_tokens: int
    decodes: int
    duration: float


class StepRecorder(Protocol):
    """Receives the latency observations a step produces (vLLM's iteration stats)."""

    def first_token(self, seq: Sequence, ttft: float) -> None: ...

    def inter_token(self, latency: float, count: int) -> None: ...

    def finished(self, seq: Sequence, now: float) -> None: ...

    def step_tokens(self, tokens: int) -> None: ...


class NullRecorder:
    def first_token(self, seq: Sequence, ttft: float) -> None:
        pass

    def inter_token(self, latency: float, count: int) -> None:
        pass

    def finished(self, seq: Sequence, now: float) -> None:
        pass

    def step_tokens(self, tokens: int) -> None:
        pass


def blocks_for(tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    return -(-tokens // block_tokens)


class Scheduler:
    def __init__(self, profile: Profile, *, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, kv_cache_tokens: int | None = None,
                 max_model_len: int | None = None, recorder: StepRecorder | None = None) -> None:
        self.profile = profile
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or profile.max_num_batched_tokens
        self.max_model_len = max_model_len or profile.max_model_len
        if self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM refuses this too: the sequences beyond the budget would never decode.
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f"greater than or equal to max_num_seqs ({self.max_num_seqs})")
        kv_tokens = kv_cache_tokens or profile.kv_cache_tokens
        self.block_tokens = profile.block_tokens
        self.pool = BlockPool(max(kv_tokens // self.block_tokens, 1))
        self.recorder: StepRecorder = recorder or NullRecorder()
        self.pending: list[tuple[float, int, Sequence]] = []
        self._order = itertools.count()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Cumulative counters, read by the metrics exposition.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self._last_completion: float | None = None

    # -- requests ----------------------------------------------------------------------------
    def add(self, seq: Sequence, ready_at: float) -> None:
        """Queue `seq`; it reaches the waiting queue at `ready_at` (after its overhead)."""
        seq.ready_at = ready_at
        heapq.heappush(self.pending, (ready_at, next(self._order), seq))

    def abort(self, seq: Sequence) -> None:
        """The client went away: free the sequence's slot and blocks now."""
        if seq.finish_reason is not None:
            return
        seq.finish_reason = "abort"
        if seq.blocks:
            self.pool.release(seq.blocks)
            seq.blocks = []
        try:
            self.running.remove(seq)
        except ValueError:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass  # still pending: dropped when it comes due

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.pending)

    def next_ready(self) -> float | None:
        """When the earliest request still in its overhead reaches the waiting queue."""
        return self.pending[0][0] if self.pending else None

    # -- one step ----------------------------------------------------------------------------
    def schedule(self, now: float) -> Step | None:
        """Plan the next step at `now`; None when nothing can run yet."""
        pending = self.pending
        while pending and pending[0][0] <= now:
            seq = heapq.heappop(pending)[2]
            if seq.finish_reason is None:
                self.waiting.append(seq)
        pool = self.pool
        running = self.running
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        num_new: list[int] = []
        prefill_tokens = 0
        decodes = 0
        preempted = False

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = blocks_for(seq.num_computed + n, self.block_tokens) - len(seq.blocks)
            scheduled = True
            while need > 0 and not pool.can_allocate(need):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    scheduled = False
                    break
            if not scheduled:
                break
            if need > 0:
                seq.blocks.extend(pool.allocate(need))
            seqs.append(seq)
            num_new.append(n)
            budget -= n
            if n == 1 and seq.num_output and seq.num_computed == seq.num_tokens - 1:
                decodes += 1
            else:
                prefill_tokens += n
            i += 1

        waiting = self.waiting
        while not preempted and waiting and budget > 0 and len(running) < self.max_num_seqs:
            seq = waiting[0]
            if seq.finish_reason is not None:
                waiting.popleft()
                continue
            hits = pool.lookup(seq.block_hashes, (seq.num_tokens - 1) // self.block_tokens)
            computed = len(hits) * self.block_tokens
            n = min(seq.num_tokens - computed, budget)
            need = blocks_for(computed + n, self.block_tokens) - len(hits)
            if not pool.can_allocate(need, hits):
                break
            waiting.popleft()
            pool.take(hits)
            seq.blocks = hits + pool.allocate(need)
            seq.num_computed = computed
            seq.registered = len(hits)
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += computed
            if seq.scheduled_at is None:
                seq.scheduled_at = now
                seq.num_cached = computed
            running.append(seq)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
            prefill_tokens += n

        if not seqs:
            return None
        profile = self.profile
        duration = (prefill_tokens * profile.prefill_s_per_token
                    + profile.decode_step_s(decodes))
        return Step(seqs, num_new, prefill_tokens, decodes, duration)

    def _preempt(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.registered = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def complete(self, step: Step, now: float) -> list[Sequence]:
        """Apply `step` as ended at `now`; the sequences that got a token, in step order.

        A sequence that finished has its finish_reason set and has left the engine.
        """
        recorder = self.recorder
        pool = self.pool
        max_model_len = self.max_model_len
        previous = self._last_completion
        emitted: list[Sequence] = []
        same_gap = 0
        prompt_tokens = 0
        any_finished = False
        for seq, n in zip(step.seqs, step.num_new, strict=True):
            if seq.finish_reason is not None:
                continue
            seq.num_computed += n
            full = min(seq.num_computed, seq.prompt_len) // self.block_tokens
            if full > seq.registered:
                end = min(full, len(seq.block_hashes))
                if end > seq.registered:
                    pool.register(seq.blocks, seq.block_hashes, seq.registered, end)
                seq.registered = full
            if seq.num_computed < seq.num_tokens:
                continue  # a chunked prefill with more to go
            seq.num_output += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
                prompt_tokens += seq.prompt_len
                recorder.first_token(seq, now - seq.arrival)
            elif seq.last_token_at == previous:
                same_gap += 1
            else:
                recorder.inter_token(now - seq.last_token_at, 1)  # type: ignore[operator]
            seq.last_token_at = now
            emitted.append(seq)
            if seq.num_output >= seq.max_tokens or seq.num_tokens >= max_model_len:
                seq.finish_reason = "length"
            elif seq.eos_at is not None and seq.num_output >= seq.eos_at:
                seq.finish_reason = "stop"
            else:
                continue
            any_finished = True
            pool.release(seq.blocks)
            seq.blocks = []
            recorder.finished(seq, now)
        if same_gap:
            recorder.inter_token(now - previous, same_gap)  # type: ignore[operator]
        if any_finished:
            self.running = [s for s in self.running if s.finish_reason is None]
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += len(emitted)
        recorder.step_tokens(prompt_tokens + len(emitted))
        self.steps += 1
        self._last_completion = now
        return emitted
