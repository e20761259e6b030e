"""Every check that can refuse a completion request, and what the request asks for.

`prepare` runs them in the order a client would fix them: a routing table, the key, the
body (`parse_completion`), the tenant's rate limits, the model (aliases applied), then the
candidate replicas and, for a model whose traffic is split between revisions, the revision.
What it finds is written on the `Exchange`; a refusal is a `ClientError`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from edge import errors
from edge.cache_salt import client_salt_problem
from edge.errors import ClientError
from edge.httpserver import Request
from edge.policy import CandidateSet
from edge.prefix import block_keys, chat_prompt_text
from edge.ratelimit import limit_key
from edge.scoring import RouteRequest
from edge.table import RoutingTable, TenantRules

if TYPE_CHECKING:
    from edge.exchange import Exchange

# Roughly four bytes of English per token; the engine's usage corrects it afterwards.
BYTES_PER_TOKEN = 4


def prepare(ex: Exchange) -> None:
    """Every check that can refuse the request, in the order a client would fix them.

    Written out flat for the common case (a key this table already knows, a model that is
    not an alias, a tenant within its limits), with what depends only on the table, the
    tenant, the model and the tier looked up once per table (`ClientApi.routes`); anything
    else goes through the general helpers, which give the same answers."""
    api = ex.api
    table = ex.edge.table
    if table is None:
        raise errors.unavailable("no_table", "This edge has no routing table yet.")
    request = ex.request
    tenant = ex.tenant = api.authenticate(request, table)
    payload = ex.payload = parse_completion(request, ex)
    route = api.routes.get((id(tenant), ex.requested_model,
                            request.headers.get(b"x-meridian-tier")))
    if route is None or api.routes_table is not table:
        cset, prefix_on = new_route(ex, table, tenant, payload)
    else:
        cset, prefix_on = known_route(ex, tenant, route)
    keys: list[int] = []
    if prefix_on and ex.prompt_text:
        keys = block_keys(ex.prompt_text, seed=cset.prefix_seed)
    if table.revisions:
        shares = table.revisions.get(ex.model)
        if shares is not None:
            split_revision(ex, table, tenant, payload, shares, keys)
    ex.route = RouteRequest(ex.model, ex.tier, keys, ex.prompt_tokens_est)
    ex.head = api.upstream_head(request, ex, len(ex.body))


def new_route(ex: Exchange, table: RoutingTable, tenant: TenantRules,
              payload: dict[str, Any]) -> tuple[CandidateSet, bool]:
    """The general path: (candidates, prefix scoring on), remembered for the next request
    when the model is not an alias."""
    api = ex.api
    request = ex.request
    # The rate limit comes before the model is looked up: a flood naming models that do
    # not exist spends the key's budget like any other.
    ex.tier = tier_of(request, tenant)
    admit(ex, tenant)
    ex.body = resolve_model(request, table, tenant, ex, payload)
    cset = ex.cset = api.candidates(table, tenant, ex.model, ex.tier)
    prefix_on = bool(len(cset.replicas) > 1 and table.policy.scorers.get("prefix"))
    if ex.model == ex.requested_model and ex.model not in table.aliases:
        api.remember_route(table, tenant, request, cset, prefix_on)
    return cset, prefix_on


def known_route(ex: Exchange, tenant: TenantRules,
                route: tuple[CandidateSet, bool]) -> tuple[CandidateSet, bool]:
    """A route this table already answered for this tenant, model and tier header."""
    cset = ex.cset = route[0]
    ex.tier = cset.tier
    ex.body = ex.request.body
    charged = 0
    if tenant.rpm > 0 or tenant.tpm > 0:
        charged = ex.edge.limiter.take(limit_key(tenant.tenant, ex.tier), tenant.rpm,
                                       tenant.tpm, ex.prompt_tokens_est, time.monotonic())
        if charged < 0:
            admit(ex, tenant)  # refuses, or admits after all
            charged = ex.charged_tokens
    ex.charged_tokens = charged
    ex.model = cset.model
    return cset, route[1]


def split_revision(ex: Exchange, table: RoutingTable, tenant: TenantRules,
                   payload: dict[str, Any], shares: tuple[tuple[str, float], ...],
                   keys: list[int]) -> None:
    """A model whose traffic is split between revisions: the candidates of this request's."""
    messages = payload.get("messages") if ex.chat else None
    cset = ex.cset = ex.api.revision_candidates(
        table, tenant, ex.model, ex.tier, shares, keys, ex.prompt_text,
        messages if isinstance(messages, list) else None)
    ex.shares = tuple(shares)
    # Counted against its revision even if no replica of it can take it (all ejected: the
    # edge's own 503); `Exchange.send_to` labels by the replica that answers.
    revision = cset.replicas[0].revision if cset.replicas else None
    if revision is not None:
        ex.revision_labels = (ex.model, revision)


def parse_completion(request: Request, ex: Exchange) -> dict[str, Any]:
    try:
        payload = orjson.loads(request.body)
    except orjson.JSONDecodeError as exc:
        raise errors.bad_request(f"The request body is not valid JSON: {exc}", None,
                                 "invalid_json") from None
    if not isinstance(payload, dict):
        raise errors.bad_request("The request body must be a JSON object.", None,
                                 "invalid_json")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise errors.bad_request("You must provide a model parameter (a string).", "model",
                                 "missing_required_parameter" if model is None else
                                 "invalid_type")
    stream = payload.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise errors.bad_request("`stream` must be a boolean.", "stream", "invalid_type")
    for name in ("max_tokens", "max_completion_tokens"):
        value = payload.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise errors.bad_request(f"`{name}` must be a positive integer.", name,
                                     "invalid_value")
    if "cache_salt" in payload:
        problem = client_salt_problem(payload["cache_salt"])
        if problem:
            raise errors.bad_request(problem, "cache_salt", "invalid_value")
        ex.client_salt = True
    # `ex.model` stays empty until the model is resolved: a request refused before then is
    # counted under a fixed label (edge.accounting), whatever name it sent.
    ex.requested_model = model
    ex.stream = bool(stream)
    text = chat_text(payload) if ex.chat else prompt_text(payload, ex)
    if text is not None:
        ex.prompt_text = text.encode()
        ex.prompt_tokens_est = len(ex.prompt_text) // BYTES_PER_TOKEN + 1
    return payload


def chat_text(payload: dict[str, Any]) -> str:
    """The text of a chat request's messages (for prefix hashing and the token estimate)."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise errors.bad_request("`messages` must be a non-empty list of messages.",
                                 "messages", "missing_required_parameter"
                                 if messages is None else "invalid_value")
    text = chat_prompt_text(messages)
    if text is None:
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise errors.bad_request(f"`messages[{i}]` must be an object with a `role`.",
                                         f"messages[{i}]", "invalid_value")
    return text or ""


def prompt_text(payload: dict[str, Any], ex: Exchange) -> str | None:
    """A completion's prompt as text; None for token ids (counted on `ex`, not hashed)."""
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "".join(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        ex.prompt_tokens_est = len(prompt)
        return None
    raise errors.bad_request("`prompt` must be a string, a list of strings or a list of "
                             "token ids.", "prompt", "missing_required_parameter"
                             if prompt is None else "invalid_value")


def tier_of(request: Request, tenant: TenantRules) -> str:
    """The tenant's tier, or batch when the request asks for it (a caller may lower its own
    priority, never raise it)."""
    wanted = request.headers.get(b"x-meridian-tier")
    if wanted is not None and wanted.lower() == b"batch":
        return "batch"
    return tenant.tier


def resolve_model(request: Request, table: RoutingTable, tenant: TenantRules, ex: Exchange,
                  payload: dict[str, Any]) -> bytes:
    """Apply aliases (at `ex.tier`); the body to forward (re-encoded only if the model
    changed)."""
    model = ex.requested_model
    alias = table.aliases.get(model)
    if alias is not None:
        target = alias.resolve(ex.prompt_tokens_est, ex.tier)
        if not (tenant.may_use_model(model) or tenant.may_use_model(target)) \
                or target not in table.models \
                or not tenant.may_know(table.models[target], table.batch_pools.get(target)):
            raise errors.model_not_found(model)
        ex.model = target
        payload["model"] = target
        return orjson.dumps(payload)
    replicas = table.models.get(model)
    if replicas is None or not tenant.may_use_model(model) \
            or not tenant.may_know(replicas, table.batch_pools.get(model)):
        raise errors.model_not_found(model)
    ex.model = model
    return request.body


def admit(ex: Exchange, tenant: TenantRules) -> None:
    """The tenant's rate limits, charged with the request's estimated tokens."""
    if tenant.rpm <= 0 and tenant.tpm <= 0:
        return
    edge = ex.edge
    verdict = edge.limiter.admit(limit_key(tenant.tenant, ex.tier), tenant.rpm, tenant.tpm,
                                 ex.prompt_tokens_est, time.monotonic())
    if not verdict.allowed:
        edge.metrics.rate_limited.inc((tenant.tenant, verdict.limit))
        raise ClientError(429, verdict.detail + f" Please try again in "
                          f"{verdict.retry_after_s}s.", code="rate_limit_exceeded",
                          type_=verdict.limit, retry_after_s=verdict.retry_after_s)
    ex.charged_tokens = verdict.charged_tokens
