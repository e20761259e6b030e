"""Per-tenant request and token rate limits: token buckets for RPM and TPM.

Each bucket holds up to one minute's allowance and refills continuously. A request takes one
request token and its estimated prompt tokens on entry; when the engine reports usage the
tenant is charged the difference (prompt + completion − estimate), so the TPM bucket may go
negative after a long completion and later requests wait it out (never more than a minute's
worth). Limits of 0 mean unlimited. Buckets belong to the tenant, not the key, and survive
table swaps, taking the new limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def limit_key(tenant: str, tier: str) -> str:
    """Whose RPM/TPM budget a request spends: batch-tier requests have one of their own (the
    tenant's limits again), so a tenant's batch never uses up its interactive budget."""
    return tenant if tier == "interactive" else tenant + "|batch"


@dataclass(slots=True)
class TenantBuckets:
    rpm: int
    tpm: int
    requests: float  # request tokens left
    tokens: float  # LLM tokens left
    updated: float

    def refill(self, now: float) -> None:
        elapsed = now - self.updated
        if elapsed <= 0:
            return
        self.updated = now
        if self.rpm:
            requests = self.requests + elapsed * self.rpm / 60.0
            self.requests = requests if requests < self.rpm else self.rpm
        if self.tpm:
            tokens = self.tokens + elapsed * self.tpm / 60.0
            self.tokens = tokens if tokens < self.tpm else self.tpm


@dataclass(slots=True)
class Verdict:
    allowed: bool
    charged_tokens: int = 0  # what admitting took from the TPM bucket
    limit: str = ""  # when refused: "requests" or "tokens"
    retry_after_s: int = 0
    detail: str = ""


def _rebase(level: float, old_limit: int, new_limit: int) -> float:
    if not old_limit:
        return float(new_limit)  # it was unlimited: start full
    return max(-float(new_limit), min(float(new_limit), new_limit - (old_limit - level)))


def _token_cost(prompt_tokens: int, tpm: int) -> int:
    # A prompt larger than a whole minute's allowance could never fit; it takes the bucket
    # down to empty instead, so it waits for a full bucket rather than forever.
    return (prompt_tokens if prompt_tokens < tpm else tpm) if tpm else 0


def _charge(buckets: TenantBuckets, rpm: int, tpm: int, prompt_tokens: int) -> int:
    """Take one request and the prompt's tokens when both fit: the tokens taken; else -1,
    with nothing taken."""
    if rpm and buckets.requests < 1.0:
        return -1
    cost = _token_cost(prompt_tokens, tpm)
    if tpm and buckets.tokens < cost:
        return -1
    if rpm:
        buckets.requests -= 1.0
    buckets.tokens -= cost
    return cost


class TenantLimiter:
    def __init__(self) -> None:
        self._tenants: dict[str, TenantBuckets] = {}

    def _buckets(self, tenant: str, rpm: int, tpm: int, now: float) -> TenantBuckets:
        buckets = self._tenants.get(tenant)
        if buckets is None:
            buckets = self._tenants[tenant] = TenantBuckets(rpm, tpm, rpm, tpm, now)
        elif buckets.rpm != rpm or buckets.tpm != tpm:
            # New limits from a new table: what was used stays used under the new allowance.
            buckets.refill(now)
            buckets.requests = _rebase(buckets.requests, buckets.rpm, rpm)
            buckets.tokens = _rebase(buckets.tokens, buckets.tpm, tpm)
            buckets.rpm, buckets.tpm = rpm, tpm
        else:
            buckets.refill(now)
        return buckets

    def admit(self, tenant: str, rpm: int, tpm: int, prompt_tokens: int, now: float) -> Verdict:
        """Take one request and `prompt_tokens` tokens, or say how long to wait."""
        buckets = self._buckets(tenant, rpm, tpm, now)
        charged = _charge(buckets, rpm, tpm, prompt_tokens)
        if charged >= 0:
            return Verdict(True, charged)
        if rpm and buckets.requests < 1.0:
            wait = (1.0 - buckets.requests) * 60.0 / rpm
            return Verdict(False, 0, "requests", max(1, math.ceil(wait)),
                           f"Rate limit reached for tenant {tenant} on requests per min (RPM): "
                           f"limit {rpm}.")
        wait = (_token_cost(prompt_tokens, tpm) - buckets.tokens) * 60.0 / tpm
        return Verdict(False, 0, "tokens", max(1, math.ceil(wait)),
                       f"Rate limit reached for tenant {tenant} on tokens per min (TPM): "
                       f"limit {tpm}, requested {prompt_tokens}.")

    def take(self, tenant: str, rpm: int, tpm: int, prompt_tokens: int, now: float) -> int:
        """`admit` for the common case: the tokens charged when the request fits, or -1 when
        it does not (then `admit` says why), with nothing allocated."""
        buckets = self._tenants.get(tenant)
        if buckets is None or buckets.rpm != rpm or buckets.tpm != tpm:
            return -1
        buckets.refill(now)
        return _charge(buckets, rpm, tpm, prompt_tokens)

    def settle(self, tenant: str, charged: int, used: int, now: float) -> None:
        """Correct a request's token charge with the usage the engine reported."""
        buckets = self._tenants.get(tenant)
        if buckets is None or not buckets.tpm or used == charged:
            return
        # No refill needed first: the level only moves by the difference.
        tokens = buckets.tokens - (used - charged)
        buckets.tokens = tokens if tokens > -buckets.tpm else -float(buckets.tpm)

    def level(self, tenant: str, kind: str, now: float) -> float | None:
        """What is left in a tenant's "requests" or "tokens" bucket now (None if unknown)."""
        buckets = self._tenants.get(tenant)
        if buckets is None:
            return None
        buckets.refill(now)
        return buckets.requests if kind == "requests" else buckets.tokens
