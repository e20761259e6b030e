"""The tokens a batch line used, read from its stored answer in SQL: what the cost and the
progress of a batch both sum."""

from __future__ import annotations

from django.db.models import Func, IntegerField


class UsageTokens(Func):
    """A line's `result.usage.total_tokens`, 0 where the engine reported none."""

    output_field = IntegerField()
    template = ("CASE WHEN jsonb_typeof(%(expressions)s -> 'usage' -> 'total_tokens') = "
                "'number' THEN (%(expressions)s -> 'usage' ->> 'total_tokens')::bigint "
                "ELSE 0 END")
