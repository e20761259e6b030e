"""Whether the edge runs its request path compiled, and the guard that keeps a bad build out.

`tools/build_edge.py` (run by `make setup`) compiles the modules in `COMPILED` to C with
mypyc into `edge/_build/`: one extension per module, the shared library that holds their
code, and `stamp.json` with the SHA-256 of every source in the package and of every file it
built. Nothing is written beside the sources, so a plain import of `edge.<module>` loads the
`.py` file. When the `edge` package is imported, `activate` checks the stamp; only if every
source is unchanged since the build, every built file is there and intact, and the build was
made for this interpreter, does it place a finder ahead of the normal import path that loads
the listed modules from the build. Anything else — no build, a failed or removed one, an
edited source, a missing or damaged file, `MERIDIAN_EDGE_PURE=1` — runs the sources, and
`BUILD.detail` says why.

The compiled and the pure modules are the same program; compiled code is only stricter (it
checks the annotated types at run time) and about 1.5 times faster per request.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
BUILD_DIR = PACKAGE_DIR / "_build"
STAMP_NAME = "stamp.json"
# The shared library holding mypyc's runtime and the compiled modules' code.
GROUP = "edge._native"
GROUP_MODULE = "_native__mypyc"
# Every module a request passes through, and the edge itself (its attributes are read on
# every request); the admin API, table pulls, keys and the command line stay interpreted.
COMPILED = (
    "accounting", "admission", "answer", "batch", "batch_forward", "cache_salt",
    "client_api", "errors", "exchange", "health", "http_listener", "http_messages",
    "httpserver", "intake", "logs", "metrics", "next_replica", "policy", "prefix",
    "ratelimit", "resume", "scoring", "server", "state", "table", "table_fields",
    "table_types", "upstream", "upstream_pool", "usage",
)
EXTENSION_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


@dataclass(frozen=True)
class Build:
    native: bool
    detail: str  # what is running and, when it is not the compiled build, why


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def source_digests(directory: Path = PACKAGE_DIR) -> dict[str, str]:
    """Every source of the package: the compiled modules are type-checked against the rest."""
    return {p.name: digest(p) for p in sorted(directory.glob("*.py"))}


def binary_names(modules: Sequence[str] = COMPILED) -> list[str]:
    return [f"{m}{EXTENSION_SUFFIX}" for m in (*modules, GROUP_MODULE)]


def stamp_for(sources: Mapping[str, str], build_dir: Path, modules: Sequence[str],
              compiler: str) -> dict[str, Any]:
    return {"compiler": compiler, "python": sys.implementation.cache_tag,
            "modules": list(modules), "sources": dict(sources),
            "binaries": {name: digest(build_dir / name) for name in binary_names(modules)}}


def _source(why: str) -> Build:
    return Build(False, f"pure Python ({why})")


def check(directory: Path = PACKAGE_DIR, build_dir: Path | None = None,
          modules: Sequence[str] = COMPILED, environ: Mapping[str, str] | None = None) -> Build:
    """What an import of the edge runs: the compiled build, or the sources and why."""
    env = os.environ if environ is None else environ
    if env.get("MERIDIAN_EDGE_PURE", "") not in ("", "0"):
        return _source("MERIDIAN_EDGE_PURE is set")
    build_dir = directory / BUILD_DIR.name if build_dir is None else build_dir
    try:
        stamp = json.loads((build_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return _source("not compiled: run `make setup` or `python tools/build_edge.py`")
    if not isinstance(stamp, dict):
        return _source("the build's stamp is damaged; run `make edge-native`")
    if stamp.get("disabled"):
        return _source("the compiled build was removed with `make edge-pure`")
    if stamp.get("failed"):
        return _source(f"the build failed: {stamp['failed']}")
    if stamp.get("python") != sys.implementation.cache_tag:
        return _source(f"compiled for {stamp.get('python')}, running "
                       f"{sys.implementation.cache_tag}")
    sources, binaries = stamp.get("sources"), stamp.get("binaries")
    if not isinstance(sources, dict) or not isinstance(binaries, dict) or \
            list(stamp.get("modules", ())) != list(modules):
        return _source("the build's stamp is damaged; run `make edge-native`")
    current = source_digests(directory)
    changed = sorted(name for name in current.keys() | sources.keys()
                     if current.get(name) != sources.get(name))
    if changed:
        return _source("changed since the compiled build: " + ", ".join(changed) +
                       "; run `make setup` to rebuild")
    for name in binary_names(modules):
        path = build_dir / name
        try:
            intact = digest(path) == binaries.get(name)
        except OSError:
            return _source(f"compiled file missing: {name}")
        if not intact:
            return _source(f"compiled file damaged: {name}; run `make edge-native`")
    return Build(True, f"compiled ({stamp.get('compiler', 'mypyc')})")


class NativeFirst:
    """A meta-path finder that loads the compiled modules, and their shared library, from
    the build directory."""

    def __init__(self, build_dir: Path, modules: Sequence[str]) -> None:
        self.paths = {f"edge.{m}": build_dir / f"{m}{EXTENSION_SUFFIX}"
                      for m in (*modules, GROUP_MODULE)}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        binary = self.paths.get(fullname)
        if binary is None:
            return None
        return importlib.util.spec_from_file_location(fullname, binary)


def activate() -> Build:
    """Called once, when the `edge` package is imported."""
    build = check()
    if build.native and not any(isinstance(f, NativeFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, NativeFirst(BUILD_DIR, COMPILED))
    return build
