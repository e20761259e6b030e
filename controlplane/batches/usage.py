"""The tokens a batch's lines used, read from their stored answers in SQL: what the cost,
the progress and the batch object's `usage` all sum, so that they never disagree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import F, Func, IntegerField, Sum

from controlplane.batches.models import Batch, LineState


class UsageTokens(Func):
    """A number in a line's `result.usage` (`total_tokens` unless another path is given,
    e.g. "prompt_tokens_details,cached_tokens"), 0 where the engine reported none."""

    output_field = IntegerField()
    template = ("CASE WHEN jsonb_typeof(%(expressions)s #> '{usage,%(path)s}') = 'number' "
                "THEN (%(expressions)s #>> '{usage,%(path)s}')::bigint ELSE 0 END")

    def __init__(self, expression: Any, path: str = "total_tokens", **extra: Any) -> None:
        if not all(part.isidentifier() for part in path.split(",")):
            raise ValueError(f"not a usage path: {path!r}")
        super().__init__(expression, path=path, **extra)


@dataclass(frozen=True)
class BatchUsage:
    """What a batch's finished lines used, as the engines reported it."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0

    def as_openai(self) -> dict[str, Any]:
        """The `usage` of OpenAI's batch object."""
        return {"input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.total_tokens}


def batch_usage(batch: Batch) -> BatchUsage:
    """One query: the usage of the batch's finished lines, summed."""
    sums = batch.lines.filter(state=LineState.DONE).aggregate(
        prompt=Sum(UsageTokens(F("result"), "prompt_tokens")),
        completion=Sum(UsageTokens(F("result"), "completion_tokens")),
        total=Sum(UsageTokens(F("result"))),
        cached=Sum(UsageTokens(F("result"), "prompt_tokens_details,cached_tokens")))
    return BatchUsage(int(sums["prompt"] or 0), int(sums["completion"] or 0),
                      int(sums["total"] or 0), int(sums["cached"] or 0))
