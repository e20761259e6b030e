"""Fault injection for chaos tests: fail with a status, hang, slow down, or die.

Switchable at run time with `POST /sim/faults` (and read with `GET /sim/faults`), or set at
start with `--fault`. The modes, as an operator would see them on a real engine:

- none: healthy.
- fail: every completion request answers `status` (default 503) with vLLM's error body;
  /health answers it too unless `health` is false (an engine that is up but refuses work).
- hang: the engine stops stepping, so streams in flight stall mid-answer, and new requests
  and /health never answer (a wedged GPU or a deadlocked worker).
- slow: every engine step and every request's overhead take `factor` times as long.
- die: the process exits at once without closing its sockets (a crashed engine); the admin
  request that asks for it is answered first.
- Mid-stream, each streamed answer after `after_tokens` tokens (default 8; requests are
  otherwise served): reset (its connection is reset), eof (the answer ends without
  `data: [DONE]`), error_event (vLLM's error event, then `[DONE]`, as when generation fails),
  stall (nothing more is sent, the connection stays open).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MID_STREAM = ("reset", "eof", "error_event", "stall")
MODES = ("none", "fail", "hang", "slow", "die", *MID_STREAM)


class FaultError(ValueError):
    """A fault request that cannot be applied; the message names the field."""


@dataclass(frozen=True)
class Faults:
    mode: str = "none"
    status: int = 503
    factor: float = 1.0
    health: bool = True
    after_tokens: int = 8

    @property
    def cuts_streams(self) -> bool:
        return self.mode in MID_STREAM

    @property
    def slow_factor(self) -> float:
        return self.factor if self.mode == "slow" else 1.0

    @property
    def fails_requests(self) -> bool:
        return self.mode == "fail"

    @property
    def fails_health(self) -> bool:
        return self.mode == "fail" and self.health

    @property
    def hangs(self) -> bool:
        return self.mode == "hang"

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "status": self.status, "factor": self.factor,
                "health": self.health, "after_tokens": self.after_tokens}


def parse_faults(body: Any) -> Faults:
    """Validate an admin request body into Faults; omitted fields take their defaults."""
    if not isinstance(body, dict):
        raise FaultError("the body must be a JSON object such as {\"mode\": \"fail\"}")
    unknown = sorted(set(body) - {"mode", "status", "factor", "health", "after_tokens"})
    if unknown:
        raise FaultError(f"unknown field(s) {unknown}; known: mode, status, factor, health, "
                         "after_tokens")
    mode = body.get("mode", "none")
    if mode not in MODES:
        raise FaultError(f"mode: must be one of {', '.join(MODES)}, not {mode!r}")
    status = body.get("status", 503)
    if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
        raise FaultError(f"status: must be an HTTP error status 400-599, not {status!r}")
    factor = body.get("factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
        raise FaultError(f"factor: must be a number > 0, not {factor!r}")
    health = body.get("health", True)
    if not isinstance(health, bool):
        raise FaultError(f"health: must be true or false, not {health!r}")
    after = body.get("after_tokens", 8)
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise FaultError(f"after_tokens: must be an integer >= 0, not {after!r}")
    return Faults(mode, status, float(factor), health, after)
