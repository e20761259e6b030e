"""Where a request whose replica failed before its answer started may go next.

A request is retried (`Exchange.retry`) on another replica while the policy's
`retry_before_first_byte` allows and no byte reached the client. For a model whose traffic
is split between revisions, a failure moves the request to the other revisions' replicas
(`widen`), and the failed attempt is counted against its revision, which is what a
rollout's analysis judges a canary by.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from edge.policy import schedule_set

if TYPE_CHECKING:
    from edge.exchange import Exchange


def may_retry(ex: Exchange) -> bool:
    """Whether the policy allows another try and no byte reached the client yet."""
    table = ex.edge.table
    limit = ex.cset.policy.retry_before_first_byte if ex.cset else 0
    return (table is not None and ex.retries < limit and not ex.client.response_started)


def another_replica_may_take_it(ex: Exchange, widen_first: bool = False) -> bool:
    """Whether a retry finds a replica (or one at capacity); with `widen_first`, among
    the other revisions' replicas first, for a split model (`widen`)."""
    assert ex.cset is not None and ex.route is not None and ex.replica is not None
    narrow = ex.cset
    if widen_first:
        widen(ex, 0)
    exclude = {ex.replica.id, *(ex.tried or ())}
    decision = schedule_set(ex.cset, ex.route, ex.edge.stats, time.monotonic(),
                            exclude=exclude)
    if decision.replica is not None or decision.reason == "at_capacity":
        return True
    if ex.cset is not narrow:  # no other revision's replica either: as it was
        ex.cset, ex.widened = narrow, False
        decision = schedule_set(narrow, ex.route, ex.edge.stats, time.monotonic(),
                                exclude=exclude)
        return decision.replica is not None or decision.reason == "at_capacity"
    return False


def widen(ex: Exchange, status: int) -> bool:
    """A split model's request whose revision failed it (a replica's 5xx or connection
    error before any byte, or none of its replicas left to pick): from now on the other
    revisions' replicas take it, the stable one's first (`ClientAPI.other_revision_
    candidates`). With `status`, the failure is counted against the failed revision
    (what a rollout's analysis judges it by) and the request's own count waits for the
    replica that answers. False when the model is not split or was widened already."""
    if ex.shares is None or ex.widened or ex.tenant is None:
        return False
    table = ex.edge.table
    if table is None:
        return False
    failed = (ex.replica.revision if ex.replica is not None
              else ex.revision_labels[1] if ex.revision_labels is not None else None)
    if failed is None:
        return False
    cset = ex.api.other_revision_candidates(table, ex.tenant, ex.model, ex.tier,
                                            ex.shares, failed)
    if cset is None:
        return False
    ex.widened = True
    ex.cset = cset
    if status:
        count_failed_attempt(ex, status)
    return True


def count_failed_attempt(ex: Exchange, status: int) -> None:
    """The attempt that failed, counted against its replica's revision; the request is
    counted again by the replica that answers it (`Exchange.send_to` labels it)."""
    labels = ex.revision_labels
    if labels is not None:
        ex.edge.metrics.revision_requests.inc((labels[0], labels[1], status))
        ex.revision_labels = None
