"""Pure parts of the edge: prefix keys and index, rate-limit buckets, ejection and backoff,
reading vLLM's /metrics, and the metrics text format."""

from __future__ import annotations

import orjson

from edge.health import (
    ReplicaStats,
    parse_engine_metrics,
    record_failure,
    record_probe,
    record_success,
)
from edge.metrics import EdgeMetrics
from edge.prefix import BLOCK_BYTES, PrefixIndex, block_keys, chat_prompt_text
from edge.ratelimit import TenantLimiter
from edge.table import Policy

# --- prefix ------------------------------------------------------------------------------


def test_block_keys_stand_for_whole_prefixes() -> None:
    system = "You are a careful assistant for a bank's support desk. " * 6
    short = block_keys(system + "How do I reset my card PIN?")
    longer = block_keys(system + "How do I reset my card PIN? And my online password?")
    shared = len(system.encode()) // BLOCK_BYTES
    assert short[:shared] == longer[:shared]
    assert block_keys("x" * (BLOCK_BYTES - 1)) == []  # only full blocks, as the engine caches
    # A change early in the prompt changes every key after it.
    assert not set(block_keys("W" + system[1:])) & set(block_keys(system))


def test_chat_text_keeps_roles_and_refuses_bad_messages() -> None:
    assert chat_prompt_text([{"role": "user", "content": "hi"}]) != chat_prompt_text(
        [{"role": "system", "content": "hi"}])
    parts = chat_prompt_text([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                           {"type": "image_url"}]}])
    assert parts is not None and "a" in parts
    assert chat_prompt_text([{"content": "no role"}]) is None


def test_prefix_index_finds_the_longest_remembered_prefix_and_forgets_the_oldest() -> None:
    index = PrefixIndex(capacity=6)
    keys = block_keys("z" * BLOCK_BYTES * 4)
    index.record(keys[:2], "a")
    index.record(keys, "b")
    assert index.matched_blocks(keys, "a") == 2
    assert index.matched_blocks(keys, "b") == 4
    assert index.matched_blocks(keys, "c") == 0
    index.record(block_keys("q" * BLOCK_BYTES * 4), "c")  # pushes the oldest blocks out
    assert len(index) == 6
    assert index.matched_blocks(keys, "b") < 4


# --- rate limits ---------------------------------------------------------------------------

def test_rpm_bucket_refuses_then_refills() -> None:
    limiter = TenantLimiter()
    assert all(limiter.admit("acme", 3, 0, 10, now=0.0).allowed for _ in range(3))
    refused = limiter.admit("acme", 3, 0, 10, now=0.0)
    assert (refused.allowed, refused.limit, refused.retry_after_s) == (False, "requests", 20)
    assert not limiter.admit("acme", 3, 0, 10, now=19.0).allowed
    assert limiter.admit("acme", 3, 0, 10, now=20.0).allowed
    # Tenants do not share buckets.
    assert limiter.admit("globex", 3, 0, 10, now=0.0).allowed


def test_tpm_charges_the_prompt_then_corrects_with_reported_usage() -> None:
    limiter = TenantLimiter()
    verdict = limiter.admit("acme", 0, 1000, 100, now=0.0)
    assert verdict.allowed and verdict.charged_tokens == 100
    assert limiter.level("acme", "tokens", 0.0) == 900
    limiter.settle("acme", charged=100, used=700, now=0.0)  # a long completion
    assert limiter.level("acme", "tokens", 0.0) == 300
    refused = limiter.admit("acme", 0, 1000, 400, now=0.0)
    assert (refused.allowed, refused.limit, refused.retry_after_s) == (False, "tokens", 6)
    # Debt is capped at one minute's allowance.
    limiter.settle("acme", charged=0, used=10_000, now=0.0)
    assert limiter.level("acme", "tokens", 0.0) == -1000


def test_a_prompt_larger_than_the_tpm_limit_waits_for_a_full_bucket() -> None:
    limiter = TenantLimiter()
    assert limiter.admit("acme", 0, 100, 5000, now=0.0).allowed
    assert not limiter.admit("acme", 0, 100, 5000, now=30.0).allowed
    assert limiter.admit("acme", 0, 100, 5000, now=60.0).allowed


def test_new_limits_from_a_new_table_apply_to_existing_buckets() -> None:
    limiter = TenantLimiter()
    for _ in range(5):
        limiter.admit("acme", 100, 0, 1, now=0.0)
    assert not limiter.admit("acme", 5, 0, 1, now=0.0).allowed
    assert limiter.admit("acme", 0, 0, 1, now=0.0).allowed  # 0 means unlimited


def test_take_charges_like_admit_and_declines_what_admit_must_decide() -> None:
    taking, admitting = TenantLimiter(), TenantLimiter()
    assert taking.take("acme", 3, 1000, 100, now=0.0) == -1  # no buckets yet
    taking.admit("acme", 3, 1000, 100, now=0.0)
    admitting.admit("acme", 3, 1000, 100, now=0.0)
    for now in (1.0, 2.0):
        assert taking.take("acme", 3, 1000, 100, now) == 100
        assert admitting.admit("acme", 3, 1000, 100, now).charged_tokens == 100
    assert taking.take("acme", 3, 1000, 100, now=2.0) == -1  # out of requests
    assert taking.level("acme", "requests", 2.0) == admitting.level("acme", "requests", 2.0)
    assert taking.level("acme", "tokens", 2.0) == admitting.level("acme", "tokens", 2.0)
    assert taking.take("acme", 5, 1000, 100, now=2.0) == -1  # new limits: admit rebases


# --- ejection ------------------------------------------------------------------------------

def test_ejection_after_consecutive_failures_with_exponential_backoff() -> None:
    policy = Policy(eject_after_failures=2, eject_base_s=1.0, eject_max_s=4.0)
    stats = ReplicaStats()
    assert record_failure(stats, policy, now=0.0) is None
    assert record_failure(stats, policy, now=0.0) == 1.0
    assert not stats.available(0.5) and stats.available(1.0)
    # On probation: the next failure ejects again, for twice as long, then capped.
    assert record_failure(stats, policy, now=1.0) == 2.0
    assert record_failure(stats, policy, now=3.0) == 4.0
    assert record_failure(stats, policy, now=7.0) == 4.0
    # Failures of requests already in flight while ejected add nothing.
    assert record_failure(stats, policy, now=8.0) is None
    record_success(stats)
    assert record_failure(stats, policy, now=20.0) is None  # the count starts over


def test_a_success_between_failures_resets_the_count() -> None:
    policy = Policy(eject_after_failures=2)
    stats = ReplicaStats()
    record_failure(stats, policy, now=0.0)
    record_success(stats)
    assert record_failure(stats, policy, now=0.0) is None


def test_probes_need_two_failures_to_mark_down_and_one_success_to_come_back() -> None:
    stats = ReplicaStats()
    assert not record_probe(stats, ok=False) and stats.probe_ok
    assert record_probe(stats, ok=False) and not stats.probe_ok
    assert record_probe(stats, ok=True) and stats.probe_ok


def test_engine_metrics_are_read_with_vllm_names() -> None:
    text = b"""# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prefix_cache_hits_total{model_name="m"} 10.0
"""
    assert parse_engine_metrics(text) == {"waiting": 5.0, "running": 7.0, "kv_usage": 0.5}
    older = b'vllm:gpu_cache_usage_perc{model_name="m"} 0.75\n'
    assert parse_engine_metrics(older)["kv_usage"] == 0.75


def test_metrics_render_in_prometheus_text_format() -> None:
    metrics = EdgeMetrics()
    metrics.requests.inc(("m", "aws:eu-west-1", 'ac"me', 200))
    metrics.ttft.observe(("m",), 0.004)
    text = metrics.registry.render().decode()
    assert ('meridian_edge_requests_total{model="m",region="aws:eu-west-1",tenant="ac\\"me",'
            'status="200"} 1') in text
    assert 'meridian_edge_time_to_first_token_seconds_bucket{model="m",le="0.005"} 1' in text
    assert 'meridian_edge_time_to_first_token_seconds_bucket{model="m",le="0.0025"} 0' in text
    assert 'meridian_edge_time_to_first_token_seconds_count{model="m"} 1' in text
    assert "# TYPE meridian_edge_table_version gauge" in text


def test_reported_usage_reads_vllms_usage_wherever_its_keys_are() -> None:
    from edge.usage import reported_usage

    answer = orjson.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": 9, "total_tokens": 21, "completion_tokens": 12,
                  "prompt_tokens_details": None}})
    assert reported_usage(answer) == (9, 12)
    chunk = b'data: {"choices":[],"usage":{"completion_tokens":3,"prompt_tokens":4}}\n\n'
    assert reported_usage(b"data: [DONE]\n\n" + chunk + b"data: [DONE]\n\n") == (4, 3)


def test_reported_usage_is_not_fooled_by_a_completion_that_talks_about_usage() -> None:
    from edge.usage import reported_usage

    text = 'the field is "usage": {"prompt_tokens": 999, "completion_tokens": 999}'
    tricky = orjson.dumps({"choices": [{"message": {"content": text}}], "usage": None})
    assert reported_usage(tricky) is None
    real = orjson.dumps({"choices": [{"message": {"content": text}}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 7}})
    assert reported_usage(real) == (5, 7)
    assert reported_usage(b'{"choices": []}') is None
    assert reported_usage(b'{"usage": {"prompt_tokens": 5}}') is None


def test_reported_usage_skips_usage_as_a_token_text_after_the_usage_object() -> None:
    """vLLM puts `prompt_logprobs` after `usage`; a prompt token whose text is "usage" is a
    string value there, and in a completion's `top_logprobs` a token text is a key with a
    number. Neither is the usage object."""
    from edge.usage import reported_usage

    answer = orjson.dumps({
        "choices": [{"text": " usage", "logprobs": {"top_logprobs": [{"usage": -0.1}]}}],
        "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
                  "prompt_tokens_details": {"cached_tokens": 0}},
        "prompt_logprobs": [None, {"5": {"logprob": -1.5, "rank": 1,
                                         "decoded_token": "usage"}}]})
    assert reported_usage(answer) == (3, 2)


def test_parsed_usage_is_the_fallback_for_other_shapes() -> None:
    from edge.usage import parsed_usage

    assert parsed_usage(b'{"usage": {"completion_tokens": 4, "prompt_tokens": 6}}') == (6, 4)
    assert parsed_usage(b'{"usage": {"prompt_tokens": true, "completion_tokens": 1}}') is None
    assert parsed_usage(b'{"usage": null}') is None
    assert parsed_usage(b"[1, 2]") is None
    assert parsed_usage(b"not json") is None
