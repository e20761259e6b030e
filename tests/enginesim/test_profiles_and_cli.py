"""Profiles (built-in and from a file) and the command line's refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from enginesim.profiles import BUILTIN, DEFAULT, PROFILE_FILE_ENV, load_profiles


def test_the_default_profile_is_the_published_8b_on_one_h100() -> None:
    profile = BUILTIN[DEFAULT]
    assert (DEFAULT, profile.overhead_s, profile.prefill_s_per_token, profile.itl_s) == (
        "llama-8b-h100", 0.030, 250e-6, 0.012)
    big = BUILTIN["llama-70b-8xh100"]
    assert (big.overhead_s, big.prefill_s_per_token, big.itl_s) == (0.080, 500e-6, 0.025)


def test_itl_grows_with_the_batch() -> None:
    profile = BUILTIN[DEFAULT]
    assert profile.itl_at(1) == profile.itl_s
    assert profile.itl_at(128) == pytest.approx(0.012 * 1.254)


def test_a_profile_file_adds_profiles(tmp_path: Path) -> None:
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps([{"name": "l4-small", "overhead_s": 0.02,
                                 "prefill_s_per_token": 0.0008, "itl_s": 0.03,
                                 "max_num_seqs": 64}]))
    profiles = load_profiles(path)
    assert profiles["l4-small"].max_num_seqs == 64
    assert DEFAULT in profiles


def test_the_profile_file_can_come_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"name": "env-one", "overhead_s": 0, "prefill_s_per_token": 0,
                                 "itl_s": 0.001}]))
    monkeypatch.setenv(PROFILE_FILE_ENV, str(path))
    assert "env-one" in load_profiles()


@pytest.mark.parametrize(("entry", "message"), [
    ({"name": "x", "overhead_s": 0, "prefill_s_per_token": 0, "itl_s": 0.01, "speed": 2},
     r"\[0\]: unknown field\(s\) \['speed'\]"),
    ({"name": "x", "overhead_s": 0}, r"\[0\]: missing field\(s\)"),
    ({"name": "x", "overhead_s": 0, "prefill_s_per_token": 0, "itl_s": -1}, "itl_s must be"),
])
def test_a_bad_profile_file_names_the_entry_and_field(tmp_path: Path, entry: dict[str, object],
                                                      message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([entry]))
    with pytest.raises(ValueError, match=message):
        load_profiles(path)


@pytest.mark.parametrize(("args", "message"), [
    (["--profile", "nope"], "--profile: unknown 'nope'"),
    (["--max-model-len", "5000", "--kv-cache-tokens", "4096"], "exceeds the KV cache"),
    (["--max-num-seqs", "0"], "--max-num-seqs: must be >= 1"),
    (["--max-num-seqs", "512", "--max-num-batched-tokens", "256"],
     "max_num_batched_tokens (256) must be greater than or equal to max_num_seqs (512)"),
])
def test_the_command_line_refuses_what_could_never_serve(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "enginesim", "--model", "m", "--port", "1",
                           *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert message in done.stderr
