"""The alert rules' names, severities and thresholds: the vocabulary that the pure rules
(`rules.py`) evaluate with and that `RuleSetting` rows (`models.py`) override. No database.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from django.db import models


class Rule(models.TextChoices):
    TTFT_SLO = "ttft_slo", "TTFT p95 over SLO"
    ITL_SLO = "itl_slo", "ITL p95 over SLO"
    ERROR_RATE = "error_rate", "Error rate (5xx share)"
    REGION_DOWN = "region_down", "Region down or degraded"
    QUOTA_EXHAUSTED = "quota_exhausted", "GPU quota exhausted"
    BUDGET = "budget", "Monthly budget"
    EDGE_TABLE_STALE = "edge_table_stale", "Edge table out of date"
    ROLLOUT_ROLLED_BACK = "rollout_rolled_back", "Rollout rolled back by its analysis"
    TABLE_ENTRY_EXCLUDED = "table_entry_excluded", "Entry left out of the routing tables"
    RULE_VIOLATED = "rule_violated", "Deployment breaks its placement rules"


class Severity(models.TextChoices):
    WARNING = "warning", "Warning"
    CRITICAL = "critical", "Critical"


@dataclass(frozen=True)
class Thresholds:
    warning: float | None
    critical: float | None
    for_s: int = 0
    window_s: int = 60
    enabled: bool = True

    def severity(self, value: float) -> str | None:
        if self.critical is not None and value >= self.critical:
            return Severity.CRITICAL
        if self.warning is not None and value >= self.warning:
            return Severity.WARNING
        return None

    def threshold(self, severity: str) -> float | None:
        return self.critical if severity == Severity.CRITICAL else self.warning


DEFAULTS: dict[str, Thresholds] = {
    Rule.TTFT_SLO: Thresholds(warning=1.0, critical=2.0, for_s=60, window_s=60),
    Rule.ITL_SLO: Thresholds(warning=1.0, critical=2.0, for_s=60, window_s=60),
    Rule.ERROR_RATE: Thresholds(warning=0.05, critical=0.20, for_s=60, window_s=300),
    Rule.REGION_DOWN: Thresholds(warning=None, critical=None),
    Rule.QUOTA_EXHAUSTED: Thresholds(warning=0.9, critical=1.0),
    Rule.BUDGET: Thresholds(warning=0.8, critical=1.0),
    Rule.EDGE_TABLE_STALE: Thresholds(warning=30.0, critical=300.0),
    # Open for window_s after the rollback (or until acknowledged and the window ends).
    Rule.ROLLOUT_ROLLED_BACK: Thresholds(warning=None, critical=None, window_s=3600),
    Rule.TABLE_ENTRY_EXCLUDED: Thresholds(warning=None, critical=None),
    # Held for a minute: a failover or a promotion that moves replicas breaks spread for
    # the seconds its replacements take to serve.
    Rule.RULE_VIOLATED: Thresholds(warning=None, critical=None, for_s=60),
}


def merged(default: Thresholds, *, enabled: bool = True, warning: float | None = None,
           critical: float | None = None, for_s: int | None = None,
           window_s: int | None = None) -> Thresholds:
    """A rule's defaults with the given overrides (None keeps the default)."""
    changes: dict[str, object] = {"enabled": enabled}
    for name, value in (("warning", warning), ("critical", critical), ("for_s", for_s),
                        ("window_s", window_s)):
        if value is not None:
            changes[name] = value
    return replace(default, **changes)  # type: ignore[arg-type]
