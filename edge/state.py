"""A completion request's state on its way through the edge, and a resumable stream's.

`RequestState` holds what `edge.exchange.Exchange` records about one request: what was
asked, where it went, what came back and when. `edge.accounting` reads it at the end and
`edge.first_byte` reads it to find a hung replica. `Resumption` holds what only a resumable
stream needs (`edge.resume`): the first leg's events until a cut, and from the first cut on
what the client has been sent across the legs. Both are plain concrete classes, so the
compiled edge reads their attributes natively.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from edge.upstream import Listener

if TYPE_CHECKING:
    from edge.health import ReplicaStats
    from edge.httpserver import HttpConnection, Request
    from edge.policy import CandidateSet, RouteRequest
    from edge.table import Replica, TenantRules
    from edge.upstream import UpstreamConnection


class Resumption:
    """A resumable stream (a 200 `text/event-stream` answer of open length): made when its
    first byte reaches the client."""

    def __init__(self, chat: bool, payload: dict[str, Any]) -> None:
        self.chat = chat
        options = payload.get("stream_options")
        # vLLM's include_usage defaults to true once stream_options is given.
        self.include_usage = isinstance(options, dict) and options.get(
            "include_usage", True) is True
        self.continuous_usage = isinstance(options, dict) and self.include_usage and \
            options.get("continuous_usage_stats") is True
        # The first leg's events relayed, until the first cut reads them.
        self.kept: list[bytes] = []
        self.held = b""  # the current leg's partial event
        self.cut = False  # a leg was cut: the legs after it are rewritten
        self.first_cut_at = 0.0
        self.resumes = 0
        self.outcome = ""  # edge.resume.OUTCOMES: the last one counted
        self.leg_sent_at = 0.0
        self.stall_timer: asyncio.TimerHandle | None = None
        # What the client has been sent, read from the events at the first cut and after.
        self.text: list[str] = []
        self.tokens = 0  # completion tokens of the legs before this one
        self.leg_events = 0  # token events of this leg
        self.leg_usage = -1  # this leg's own count, once its engine reports one
        self.prompt_tokens = -1
        self.id: Any = None
        self.created: Any = None
        self.model: Any = None
        self.role_sent = False
        self.tools = False
        self.finished = False  # a finish_reason reached the client
        self.leg_done = False  # this leg sent [DONE]

    def mark_cut(self) -> None:
        if not self.cut:
            self.cut = True
            self.first_cut_at = time.monotonic()

    @property
    def sent_tokens(self) -> int:
        return self.tokens + (self.leg_usage if self.leg_usage >= 0 else self.leg_events)

    def end_leg(self) -> None:
        self.tokens = self.sent_tokens
        self.leg_events = 0
        self.leg_usage = -1
        self.leg_done = False
        self.held = b""

    def usage(self, fallback_prompt: int) -> dict[str, int]:
        prompt = self.prompt_tokens if self.prompt_tokens >= 0 else fallback_prompt
        completion = self.sent_tokens
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion}


class RequestState(Listener):
    """What the edge knows about one completion request. Defaults live on the class: a
    request sets only what it changes, which keeps creating one cheap."""

    request: Request
    client: HttpConnection
    request_id: bytes
    chat: bool
    upstream_path: bytes
    tenant: TenantRules | None = None
    requested_model = ""
    model = ""
    stream = False
    tier = "interactive"
    prompt_text = b""
    prompt_tokens_est = 0
    charged_tokens = 0
    cset: CandidateSet | None = None
    route: RouteRequest | None = None
    head = b""
    body = b""
    # The same with the tenant's `cache_salt` (edge.cache_salt), made when a replica that
    # keeps tenants' caches apart is first chosen; whether the client sent one of its own.
    salted_head = b""
    salted_body = b""
    client_salt = False
    replica: Replica | None = None
    # (model, revision) of the replica sending the answer, for a model whose traffic is split
    # between revisions: what the edge's per-revision metrics are labelled with.
    revision_labels: tuple[str, str] | None = None
    stats: ReplicaStats | None = None  # set while this request holds a slot on the replica
    upstream: UpstreamConnection | None = None
    tried: set[str] | None = None
    retries = 0
    # A split model's revision shares, and whether a failure already moved the request to
    # the other revisions' replicas (`widen`).
    shares: tuple[tuple[str, float], ...] | None = None
    widened = False
    last_failure = ""  # why the last replica tried failed, when one did
    fresh_connection = False
    task: asyncio.Task[None] | None = None
    deadline = 0.0
    queued_s = 0.0
    status = 0
    code = ""
    client_started = False
    finished = False
    sent_at = 0.0
    head_at = 0.0
    first_byte_at = 0.0
    last_byte_at = 0.0
    overhead_s = 0.0
    events = 0
    # The last two reads of a streamed answer: where its usage chunk is.
    prev_chunk = b""
    last_chunk = b""
    prompt_tokens = 0
    completion_tokens = 0
    usage_reported = False
    payload: dict[str, Any] | None = None
    error_body = b""  # an engine's 4xx answer, gathered to be re-worded
    resumption: Resumption | None = None  # a stream that can be resumed (edge.resume)
