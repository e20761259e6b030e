"""The end of every request: its metrics, the tenant's token correction, its access-log line.

Every answered request, error or not, comes here once (`Exchange.complete`). Profiled, this
is the largest single step of a JSON request after the kernel's work (about an eighth of the
edge's time per request: the access-log line, then the counters and histograms).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import orjson

from edge.ratelimit import limit_key
from edge.state import RequestState

if TYPE_CHECKING:
    from edge.server import Edge

# The model label of a request refused before its model was resolved (bad key, bad body,
# rate limit, a model that does not exist or that the key may not use): one fixed series,
# so that requests naming random models cannot add series without end. The name they sent
# is in the access log.
UNRESOLVED_MODEL = "unknown"


def account(edge: Edge, exchange: RequestState) -> None:
    """Count the request in the metrics, settle its tokens, write its access-log line."""
    metrics = edge.metrics
    tenant_rules = exchange.tenant
    tenant = tenant_rules.tenant if tenant_rules is not None else ""
    replica = exchange.replica
    model = exchange.model
    status = exchange.status or 499
    request = exchange.request
    started = request.received_at
    end = exchange.last_byte_at or time.perf_counter()
    region = replica.region if replica is not None else ""
    metrics.requests.inc((model or UNRESOLVED_MODEL, region, tenant, status))
    ttft = exchange.first_byte_at - started if exchange.first_byte_at else None
    if ttft is not None:
        metrics.overhead.observe((), exchange.overhead_s)
    # Latency counts successful answers only (those whose head said so, the client's own
    # disconnect after it included): an error body is written at once, and a revision
    # answering nothing but 5xx would otherwise look the fastest. The error rate beside it
    # is the requests counter's.
    answered_ttft = ttft if ttft is not None and (status < 400 or exchange.status == 0) else None
    if answered_ttft is not None:
        metrics.ttft.observe((model,), answered_ttft)
    labels = exchange.revision_labels
    if labels is not None:
        metrics.revision_requests.inc((labels[0], labels[1], status))
        if answered_ttft is not None:
            metrics.revision_ttft.observe(labels, answered_ttft)
    if exchange.prompt_tokens or exchange.completion_tokens:
        metrics.tokens.inc((model, region, tenant, "prompt"), exchange.prompt_tokens)
        metrics.tokens.inc((model, region, tenant, "completion"), exchange.completion_tokens)
        if tenant_rules is not None and tenant_rules.tpm > 0:
            edge.limiter.settle(limit_key(tenant, exchange.tier), exchange.charged_tokens,
                                exchange.prompt_tokens + exchange.completion_tokens,
                                time.monotonic())
    if exchange.status == 0:
        metrics.client_disconnects.inc()
    if edge.access_log.enabled:
        edge.access_log.write(access_line(edge, exchange, status, ttft, end - started))


def access_line(edge: Edge, exchange: RequestState, status: int, ttft: float | None,
                duration_s: float) -> bytes:
    """The request's access-log line."""
    tenant_rules = exchange.tenant
    replica = exchange.replica
    region = replica.region if replica is not None else ""
    model = exchange.model
    resumption = exchange.resumption
    return orjson.dumps({
        "ts": time.time(),
        "edge": edge.name,
        "request_id": exchange.request_id.decode(),
        "client": exchange.request.peer,
        "path": exchange.request.path,
        "status": status,
        "code": exchange.code or None,
        "tenant": tenant_rules.tenant or None if tenant_rules is not None else None,
        "model": model or exchange.requested_model or None,
        "requested_model": exchange.requested_model or None,
        "tier": exchange.tier,
        "stream": exchange.stream,
        "replica": replica.id if replica is not None else None,
        "region": region or None,
        "retries": exchange.retries,
        "resumptions": resumption.resumes if resumption is not None else 0,
        "resume_outcome": resumption.outcome or None if resumption is not None else None,
        "last_failure": exchange.last_failure or None,
        "queued_s": exchange.queued_s,
        "ttft_s": ttft,
        "duration_s": duration_s,
        "overhead_s": exchange.overhead_s,
        "prompt_tokens": exchange.prompt_tokens,
        "completion_tokens": exchange.completion_tokens,
        "usage_reported": exchange.usage_reported,
        "bytes_out": exchange.client.bytes_sent,
    })
