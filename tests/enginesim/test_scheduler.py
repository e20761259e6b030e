"""The engine model on a virtual clock: every expected time below is worked out by hand from
the test profile (30 ms overhead, 1 ms per prefill token, 10 ms decode step growing 1% per
extra sequence, 8 sequences, 256 tokens per step, 64 KV blocks of 16 tokens)."""

from __future__ import annotations

import itertools

import pytest

from enginesim.scheduler import Scheduler

from .conftest import PROFILE, run_virtual, seq_of


def test_a_lone_request_waits_overhead_plus_its_prefill_then_decodes_at_the_profile_itl(
        scheduler: Scheduler) -> None:
    seq = seq_of(100, max_tokens=4)
    trace = run_virtual(scheduler, [seq])
    assert trace.of(seq) == pytest.approx([0.130, 0.140, 0.150, 0.160])
    assert seq.finish_reason == "length"
    assert scheduler.prompt_tokens == 100 and scheduler.generation_tokens == 4


def test_decode_steps_grow_with_the_batch(scheduler: Scheduler) -> None:
    seqs = [seq_of(10, max_tokens=5) for _ in range(4)]
    trace = run_virtual(scheduler, seqs)
    for seq in seqs:
        times = trace.of(seq)
        assert times[0] == pytest.approx(0.030 + 0.040)  # one step prefills all four
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert gaps == pytest.approx([0.0103] * 4)  # 10 ms × (1 + 1% × 3)


def test_a_long_prefill_slows_the_decoding_stream_it_shares_steps_with(
        scheduler: Scheduler) -> None:
    decoding = seq_of(10, max_tokens=30)
    long_prompt = seq_of(600, max_tokens=2, arrival=0.105)
    trace = run_virtual(scheduler, [decoding, long_prompt])
    times = trace.of(decoding)
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(times)]
    # From 0.140 s: chunks of 255 prompt tokens (the 256-token step less one decode token),
    # then the last 90; then both decode together.
    assert gaps[9:14] == pytest.approx([0.010, 0.265, 0.265, 0.100, 0.0101])
    # TTFT: overhead, 5 ms waiting for the step in flight, the prefill, the decode shares.
    assert trace.of(long_prompt)[0] - long_prompt.arrival == pytest.approx(
        0.030 + 0.005 + 0.600 + 3 * 0.010)


def test_a_prompt_longer_than_the_step_budget_is_prefilled_in_chunks(
        scheduler: Scheduler) -> None:
    seq = seq_of(600, max_tokens=1)
    trace = run_virtual(scheduler, [seq])
    assert trace.steps == pytest.approx([0.256, 0.256, 0.088])
    assert trace.of(seq) == pytest.approx([0.030 + 0.600])


def test_a_repeated_prompt_reuses_its_cached_blocks(scheduler: Scheduler) -> None:
    prompt = "Meridian routes each request to the best healthy replica. " * 14  # 812 chars
    first = seq_of(prompt, max_tokens=1)
    run_virtual(scheduler, [first])
    assert first.prompt_len == 203
    second = seq_of(prompt, max_tokens=1, arrival=1.0)
    trace = run_virtual(scheduler, [second])
    # 12 full blocks (192 tokens) come from the cache; 11 tokens are computed.
    assert second.num_cached == 192
    assert trace.of(second)[0] - second.arrival == pytest.approx(0.030 + 0.011)
    assert scheduler.prefix_queries == 2 * 203
    assert scheduler.prefix_hits == 192


def test_the_last_prompt_token_is_always_computed(scheduler: Scheduler) -> None:
    prompt = "x" * 128  # exactly two blocks
    run_virtual(scheduler, [seq_of(prompt, max_tokens=1)])
    again = seq_of(prompt, max_tokens=1, arrival=1.0)
    trace = run_virtual(scheduler, [again])
    assert again.num_cached == 16
    assert trace.of(again)[0] - again.arrival == pytest.approx(0.030 + 0.016)


def test_a_different_beginning_misses_even_when_later_blocks_match(
        scheduler: Scheduler) -> None:
    shared_tail = "y" * 640
    run_virtual(scheduler, [seq_of("a" * 64 + shared_tail, max_tokens=1)])
    other = seq_of("b" * 64 + shared_tail, max_tokens=1, arrival=1.0)
    run_virtual(scheduler, [other])
    assert other.num_cached == 0


def test_requests_beyond_max_num_seqs_wait_for_a_slot() -> None:
    scheduler = Scheduler(PROFILE, max_num_seqs=2)
    a, b, c = (seq_of(10, max_tokens=3) for _ in range(3))
    trace = run_virtual(scheduler, [a, b, c])
    assert trace.of(a) == pytest.approx([0.050, 0.0601, 0.0702])
    # c is admitted when a and b finish: queueing is added to its TTFT.
    assert trace.of(c)[0] == pytest.approx(0.0702 + 0.010)


def test_when_kv_runs_out_the_newest_sequence_is_preempted_and_recomputed_later() -> None:
    scheduler = Scheduler(PROFILE, kv_cache_tokens=8 * 16)
    seqs = [seq_of(30, max_tokens=40) for _ in range(3)]
    trace = run_virtual(scheduler, seqs)
    assert scheduler.preemptions > 0
    assert sum(s.preemptions for s in seqs) == scheduler.preemptions
    for seq in seqs:
        assert seq.finish_reason == "length" and seq.num_output == 40
        times = trace.of(seq)
        assert len(times) == 40 and times == sorted(times)
    assert scheduler.pool.num_free == scheduler.pool.num_blocks
    assert not scheduler.running and not scheduler.waiting


def test_an_aborted_sequence_gives_back_its_slot_and_blocks(scheduler: Scheduler) -> None:
    seq = seq_of(100, max_tokens=50)
    scheduler.add(seq, 0.0)
    step = scheduler.schedule(0.0)
    assert step is not None
    scheduler.complete(step, step.duration)
    assert scheduler.pool.num_free < scheduler.pool.num_blocks
    scheduler.abort(seq)
    assert seq.finish_reason == "abort"
    assert scheduler.pool.num_free == scheduler.pool.num_blocks
    assert scheduler.schedule(1.0) is None and not scheduler.has_work


def test_an_aborted_sequence_in_a_step_in_flight_gets_no_token(scheduler: Scheduler) -> None:
    seq = seq_of(10, max_tokens=5)
    scheduler.add(seq, 0.0)
    step = scheduler.schedule(0.0)
    assert step is not None
    scheduler.abort(seq)
    assert scheduler.complete(step, 1.0) == []


@pytest.mark.parametrize(("max_tokens", "eos_at", "tokens", "reason"), [
    (10, 3, 3, "stop"),     # the model ends its answer
    (3, 3, 3, "length"),    # vLLM checks the length cap before the end-of-sequence token
    (5, None, 5, "length"),
])
def test_finish_reasons_follow_vllm(scheduler: Scheduler, max_tokens: int, eos_at: int | None,
                                    tokens: int, reason: str) -> None:
    seq = seq_of(10, max_tokens=max_tokens, eos_at=eos_at)
    run_virtual(scheduler, [seq])
    assert (seq.num_output, seq.finish_reason) == (tokens, reason)


def test_generation_stops_at_the_context_length(scheduler: Scheduler) -> None:
    seq = seq_of(1020, max_tokens=100)
    run_virtual(scheduler, [seq])
    assert (seq.num_output, seq.finish_reason) == (4, "length")


def test_a_request_still_in_its_overhead_is_not_waiting_yet(scheduler: Scheduler) -> None:
    seq = seq_of(10, max_tokens=1)
    scheduler.add(seq, 0.030)
    assert scheduler.schedule(0.0) is None
    assert scheduler.next_ready() == pytest.approx(0.030)
    assert not scheduler.waiting and scheduler.has_work
    assert scheduler.schedule(0.030) is not None
