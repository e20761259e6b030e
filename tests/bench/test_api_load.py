"""bench/api_load.py's side-by-side run: which tier each slice of load goes to, and what the
second web tier changes in the lab's gunicorn command."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from controlplane.lab.status_lane import REQUEST_NICE_ENV


def api_load() -> ModuleType:
    """bench/api_load.py as a module (bench/ is no package); registered first, as its
    dataclasses need."""
    if (loaded := sys.modules.get("bench_api_load")) is not None:
        return loaded
    path = Path(__file__).resolve().parents[2] / "bench" / "api_load.py"
    spec = importlib.util.spec_from_file_location("bench_api_load", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_both_tiers_get_the_seconds_asked_in_turns_that_mirror_each_other() -> None:
    bench = api_load()
    assert bench.SLICE_S == 5.0
    assert bench.slices(["lab", "unniced"], 10.0) == ["lab", "unniced", "unniced", "lab"]
    assert bench.slices(["lab", "unniced"], 30.0) == ["lab", "unniced", "unniced", "lab"] * 3
    assert bench.slices(["lab", "unniced"], 3.0) == ["lab", "unniced"]
    assert bench.slices(["lab"], 12.0) == ["lab"] * 3


def test_the_second_tier_changes_one_thing_in_the_lab_command() -> None:
    bench = api_load()
    argv, env = bench.variant_command("unniced", 4321)
    assert argv[argv.index("--bind") + 1] == "127.0.0.1:4321"
    assert argv[argv.index("--worker-class") + 1] == (
        "controlplane.lab.status_lane.StatusLaneWorker")
    assert env == {REQUEST_NICE_ENV: "0"}
    plain, env = bench.variant_command("plain", 4321)
    assert "--worker-class" not in plain and env == {}
    assert plain == argv[:argv.index("--worker-class")]
