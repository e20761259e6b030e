"""Fault injection for chaos tests, switchable at run time: fail, hang, slow down, die."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

MODES = ("none", "fail", "hang", "slow", "die")


@dataclass
class Faults:
    mode: str = "none"
    status: int = 500
    factor: float = 1.0

    def set(self, body: dict[str, Any]) -> None:
        mode = body.get("mode", "none")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        status = int(body.get("status", 500))
        if not 400 <= status <= 599:
            raise ValueError("status must be an HTTP error status (400-599)")
        factor = float(body.get("factor", 1.0))
        if factor <= 0:
            raise ValueError("factor must be > 0")
        self.mode, self.status, self.factor = mode, status, factor
        if mode == "die":
            os._exit(1)  # as abrupt as a crashed engine: no cleanup, sockets reset

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
