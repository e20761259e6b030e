"""Who an audit event about a batch or a file names.

The events themselves are written by database triggers (migration 0003): every change to a
batch's status or timestamps, every upload and deletion, in the transaction that makes it,
whatever code makes it. The triggers read the actor and reason from two settings of the
database connection; `acting_as` sets them for the work done inside it. Work done outside
(a Celery worker running or finishing a batch) is recorded as `system:batches`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection

SYSTEM_ACTOR = "system:batches"
_SET = ("SELECT set_config('meridian.audit_actor', %s, false), "
        "set_config('meridian.audit_reason', %s, false)")


@contextmanager
def acting_as(actor: str, reason: str = "") -> Iterator[None]:
    """Changes to batches and files made inside are `actor`'s, for `reason`.

    The settings are the session's, not a transaction's, so they hold across the several
    transactions one action may take (cancel, then finish the batch) and are cleared on
    the way out. A transaction that is rolled back takes a setting made inside it along.
    """
    with connection.cursor() as cursor:
        cursor.execute(_SET, [actor[:150], reason])
    try:
        yield
    finally:
        if not connection.needs_rollback:
            with connection.cursor() as cursor:
                cursor.execute(_SET, ["", ""])


def api_actor(tenant_name: str, key_name: str) -> str:
    """How a tenant's inference key appears in the audit log."""
    return f"key:{tenant_name}/{key_name}"
