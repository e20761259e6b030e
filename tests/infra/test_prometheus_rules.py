"""The Prometheus rules operators load (infra/prometheus/rules/): promtool checks them and runs
their unit tests, every alert has a test that fires it and a runbook section, and the lab's
Prometheus loads them from beside its copied config."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.lab.processes import die_with_parent
from controlplane.lab.prometheus import CONFIG, RULES, free_port, prometheus_argv, wait_ready

RULE_FILES = sorted(RULES.glob("*.yml"))
RULE_TESTS = sorted((RULES / "tests").glob("*.yml"))
RUNBOOK = CONFIG.parents[2] / "docs" / "runbook.md"
RECORD_NAME = re.compile(r"^[a-z_]+:[a-z0-9_]+:[a-z0-9_]+$")


def promtool() -> str:
    """promtool's path. It comes with Debian's prometheus (tools/ensure_prometheus.sh): where
    that could not be installed the rules are not checked, as the other Prometheus tests
    skip; a prometheus without its promtool is a broken install and fails."""
    binary = shutil.which("promtool")
    if binary is None:
        if shutil.which("prometheus") is not None:
            pytest.fail("prometheus is installed but promtool is not on PATH")
        pytest.skip("no promtool (tools/ensure_prometheus.sh installs Debian's prometheus)")
    return binary


def rules_of(kind: str) -> Iterator[dict[str, Any]]:
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            yield from (rule for rule in group["rules"] if kind in rule)


def test_the_rule_files_are_the_recording_and_alerting_rules() -> None:
    assert [p.name for p in RULE_FILES] == ["meridian-alerts.yml", "meridian-recording.yml"]
    assert RULE_TESTS, "no promtool unit tests"


def test_promtool_finds_the_rules_valid() -> None:
    result = subprocess.run([promtool(), "check", "rules", *map(str, RULE_FILES)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_pass_their_promtool_unit_tests() -> None:
    # Rule files in the tests are named relative to each test file.
    result = subprocess.run([promtool(), "test", "rules", *(p.name for p in RULE_TESTS)],
                            capture_output=True, text=True, timeout=120, cwd=RULES / "tests")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(RULE_TESTS), result.stdout


def test_recording_rules_are_named_level_metric_operations() -> None:
    names = [rule["record"] for rule in rules_of("record")]
    assert names and len(names) == len(set(names))
    assert [n for n in names if not RECORD_NAME.match(n)] == []


def fired_in_tests() -> set[tuple[str, str]]:
    """(alert name, severity) of every alert some promtool test expects to fire."""
    fired = set()
    for path in RULE_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                for alert in case.get("exp_alerts") or []:
                    fired.add((case["alertname"], alert["exp_labels"]["severity"]))
    return fired


def test_every_alert_has_a_promtool_test_that_fires_it() -> None:
    alerts = {(rule["alert"], rule["labels"]["severity"]) for rule in rules_of("alert")}
    assert len(alerts) >= 8
    assert alerts - fired_in_tests() == set()
    # and no test expects an alert the rules do not have
    assert fired_in_tests() - alerts == set()


def runbook_anchors() -> set[str]:
    """The anchors GitHub gives docs/runbook.md's headings."""
    headings = re.findall(r"^#+ (.+)$", RUNBOOK.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_alert_has_a_severity_summary_description_and_a_runbook_section() -> None:
    anchors = runbook_anchors()
    for rule in rules_of("alert"):
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook"}, rule["alert"]
        page, anchor = annotations["runbook"].split("#")
        assert page == "docs/runbook.md"
        assert anchor == rule["alert"].lower() and anchor in anchors, rule["alert"]


def rules_loaded(url: str) -> dict[str, list[str]]:
    with urllib.request.urlopen(f"{url}/api/v1/rules", timeout=10) as response:
        groups = json.loads(response.read())["data"]["groups"]
    return {g["name"]: [r["name"] for r in g["rules"]] for g in groups}


def test_the_labs_prometheus_loads_the_rules_copied_beside_its_config(tmp_path: Path) -> None:
    promtool()  # the same installation
    binary = shutil.which("prometheus")
    assert binary is not None
    port = free_port()
    argv = prometheus_argv(tmp_path, f"127.0.0.1:{port}", binary=binary)
    assert argv is not None
    home = tmp_path / "prometheus"
    assert sorted(p.name for p in (home / "rules").iterdir()) == [p.name for p in RULE_FILES]
    for name in ("replicas.json", "replicas-plain.json", "edges.json"):
        (home / "targets" / name).write_text("[]")
    with open(tmp_path / "prometheus.log", "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   preexec_fn=die_with_parent())
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_ready(url, 30, lambda: process.poll() is None), \
            (tmp_path / "prometheus.log").read_text()[-2000:]
        loaded = rules_loaded(url)
    finally:
        process.kill()
        process.wait()
    expected: dict[str, list[str]] = {}
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            expected[group["name"]] = [r.get("record") or r["alert"] for r in group["rules"]]
    assert loaded == expected
