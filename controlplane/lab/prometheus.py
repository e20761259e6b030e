"""Prometheus in the lab, when its binary is installed: the shipped config, copied beside the
target files the control plane writes, and the command line to run it."""

from __future__ import annotations

import shutil
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[2] / "infra" / "prometheus" / "prometheus.yml"


def prometheus_argv(var_dir: Path, listen: str, binary: str | None = None) -> list[str] | None:
    """The command that runs Prometheus over `var_dir/prometheus`, or None when there is no
    `prometheus` on PATH (telemetry then scrapes replicas itself)."""
    binary = binary or shutil.which("prometheus")
    if not binary:
        return None
    home = (var_dir / "prometheus").resolve()
    (home / "targets").mkdir(parents=True, exist_ok=True)
    config = home / "prometheus.yml"
    shutil.copyfile(CONFIG, config)
    return [binary, f"--config.file={config}", f"--storage.tsdb.path={home / 'data'}",
            "--storage.tsdb.retention.time=2d", f"--web.listen-address={listen}"]
