"""A rollout's settings from what an operator sent: checked field by field
(`RolloutInputError` names the field) and returned typed, as the `RolloutRequest` that
`lifecycle.start` takes. The API's serializer and the dashboard's form both build it here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from controlplane.deployments.models import Deployment, Model
from controlplane.rollouts import analysis
from controlplane.rollouts.models import Strategy
from regions.models import GpuType, Region

DEFAULT_STEPS = (5, 25, 50, 100)
DEFAULT_BAKE_S = 300
DEFAULT_ROLLBACK_WINDOW_S = 600


class RolloutInputError(ValueError):
    """Bad rollout settings; `field` names which."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class RevisionSpec:
    """The new revision's settings; those left None (and engine arguments not given) are
    the stable revision's."""

    model: Model | None = None
    vllm_version: str | None = None
    engine_args: Mapping[str, object] = field(default_factory=dict)
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    preferred_gpu_type: GpuType | None = None


@dataclass(frozen=True)
class RolloutRequest:
    """A rollout's checked settings: its steps (%), each held bake_s, the blue/green
    rollback window (0 for a canary), waves of edge regions, the thresholds each step is
    judged by (the deployment's defaults with the overrides given), and the new revision."""

    strategy: str
    steps: list[int]
    bake_s: int
    rollback_window_s: int
    waves: list[list[str]]
    auto_promote: bool
    thresholds: dict[str, float]
    reason: str = ""
    revision: RevisionSpec = field(default_factory=RevisionSpec)


def rollout_request(deployment: Deployment, raw: Mapping[str, object],
                    revision: RevisionSpec | None = None, reason: str = "") -> RolloutRequest:
    """The rollout of `deployment` that `raw` asks for (strategy, steps, bake_s,
    rollback_window_s, waves, auto_promote, thresholds as sent, any left out taking their
    defaults), checked. Raises RolloutInputError naming the first bad field."""
    strategy, steps, window = check_strategy(raw.get("strategy", Strategy.CANARY),
                                             raw.get("steps"), raw.get("rollback_window_s"))
    bake_s = raw.get("bake_s", DEFAULT_BAKE_S)
    weights = check_steps(steps, bake_s)
    assert isinstance(bake_s, int)  # check_steps refused anything else
    wave_regions = check_waves(raw.get("waves"), strategy)
    auto_promote = raw.get("auto_promote", True)
    if not isinstance(auto_promote, bool):
        raise RolloutInputError("auto_promote", f"auto_promote must be true or false, not "
                                f"{auto_promote!r}")
    try:
        limits = analysis.check_thresholds(
            raw.get("thresholds"), analysis.defaults_for(deployment.slo_ttft_p95_ms))
    except analysis.ThresholdError as exc:
        raise RolloutInputError(exc.field, str(exc)) from None
    return RolloutRequest(strategy=strategy, steps=weights, bake_s=bake_s,
                          rollback_window_s=window, waves=wave_regions,
                          auto_promote=auto_promote, thresholds=limits, reason=reason,
                          revision=revision or RevisionSpec())


def check_strategy(strategy: object, steps: object,
                   rollback_window_s: object) -> tuple[str, object, int]:
    """(strategy, steps, rollback window): blue/green is one step of 100% and a window;
    a canary has no window."""
    if strategy not in Strategy.values:
        raise RolloutInputError("strategy", f"strategy must be one of "
                                            f"{', '.join(Strategy.values)}, not {strategy!r}")
    assert isinstance(strategy, str)
    if strategy == Strategy.CANARY:
        if rollback_window_s is not None:
            raise RolloutInputError("rollback_window_s", "rollback_window_s is for blue_green "
                                                         "rollouts only")
        return strategy, DEFAULT_STEPS if steps is None else steps, 0
    if steps is not None and (not isinstance(steps, (list, tuple)) or list(steps) != [100]):
        raise RolloutInputError("steps", "a blue_green rollout switches all traffic at once: "
                                         "leave steps out (or give [100])")
    window = DEFAULT_ROLLBACK_WINDOW_S if rollback_window_s is None else rollback_window_s
    if isinstance(window, bool) or not isinstance(window, int) or not 0 < window <= 86400:
        raise RolloutInputError("rollback_window_s", f"rollback_window_s must be a whole "
                                                     f"number of seconds in (0, 86400], not "
                                                     f"{window!r}")
    return strategy, [100], window


def check_steps(steps: object, bake_s: object) -> list[int]:
    """The step weights, each a whole percentage, increasing to 100; bake_s a whole
    number of seconds."""
    if not isinstance(steps, (list, tuple)) or not steps:
        raise RolloutInputError("steps", "steps must be a non-empty list of weights (%)")
    weights: list[int] = []
    for weight in steps:
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 < weight <= 100:
            raise RolloutInputError("steps", f"each step is a whole percentage in (0, 100], "
                                             f"not {weight!r}")
        if weights and weight <= weights[-1]:
            raise RolloutInputError("steps", f"weights must increase: {weight} after "
                                             f"{weights[-1]}")
        weights.append(weight)
    if weights[-1] != 100:
        raise RolloutInputError("steps", f"the last step must be 100, not {weights[-1]}")
    if isinstance(bake_s, bool) or not isinstance(bake_s, int) or bake_s <= 0:
        raise RolloutInputError("bake_s", f"bake_s must be a whole number of seconds > 0, "
                                          f"not {bake_s!r}")
    return weights


def check_waves(waves: object, strategy: str) -> list[list[str]]:
    """Waves of edge regions: lists of known `cloud:code` keys, none twice."""
    if waves is None or waves == []:
        return []
    if strategy != Strategy.CANARY:
        raise RolloutInputError("waves", "waves are for canary rollouts only")
    if not isinstance(waves, list) or not all(isinstance(w, list) and w for w in waves):
        raise RolloutInputError("waves", "waves must be a list of non-empty lists of regions "
                                         "(cloud:code), such as [[\"aws:eu-central-1\"], "
                                         "[\"aws:us-east-1\"]]")
    seen: set[str] = set()
    for i, wave in enumerate(waves):
        for j, key in enumerate(wave):
            field_name = f"waves[{i}][{j}]"
            if not isinstance(key, str) or not Region.objects.filter(
                    **Region.key_filter(key)).exists():
                raise RolloutInputError(field_name, f"no region {key!r}; use cloud:code")
            if key in seen:
                raise RolloutInputError(field_name, f"region {key} is in two waves")
            seen.add(key)
    return [list(w) for w in waves]
