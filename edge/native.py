"""Whether the edge runs its hot path compiled, and the guard that keeps a stale build out.

`tools/build_edge.py` (run by `make setup`) compiles the modules in `COMPILED` to C with
mypyc and leaves each extension beside its source, where Python's import prefers it, plus a
stamp (`_native.json`) holding the digest of every source it compiled. The sources stay the
truth: a build is used only while every compiled source is unchanged since it was made. When
a source has changed, when the stamp is missing, or when `MERIDIAN_EDGE_PURE=1` asks for it,
a finder placed ahead of the normal import path loads those modules from their `.py` files
instead, so an edited edge never runs yesterday's code.

The compiled and the pure modules are the same program; compiled code is only stricter (it
checks the annotated types at run time) and about 1.6 times faster per request.
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

PACKAGE_DIR = Path(__file__).resolve().parent
STAMP = PACKAGE_DIR / "_native.json"
# The shared library holding mypyc's runtime and the compiled modules' code.
GROUP = "edge._native"
# Every module a request passes through, and the edge itself (its attributes are read on
# every request); the admin API, table pulls, keys and the command line stay interpreted.
COMPILED = (
    "admission", "batch", "errors", "health", "httpserver", "logs", "metrics", "policy",
    "prefix", "proxy", "ratelimit", "server", "table", "upstream",
)


@dataclass(frozen=True)
class Build:
    native: bool
    detail: str  # what is running and, when it is not the compiled build, why


def source_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stamp_for(directory: Path, modules: Sequence[str], compiler: str) -> dict[str, object]:
    return {"compiler": compiler, "python": sys.implementation.cache_tag,
            "sources": {m: source_digest(directory / f"{m}.py") for m in modules}}


def check(directory: Path = PACKAGE_DIR, modules: Sequence[str] = COMPILED,
          environ: Mapping[str, str] | None = None) -> Build:
    """What an import of the edge would run: the compiled build, or the sources and why."""
    env = os.environ if environ is None else environ
    if env.get("MERIDIAN_EDGE_PURE", "") not in ("", "0"):
        return Build(False, "pure Python (MERIDIAN_EDGE_PURE is set)")
    stamp_path = directory / STAMP.name
    try:
        stamp = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        return Build(False, "pure Python (not compiled: run `make setup` or "
                            "`python tools/build_edge.py`)")
    if stamp.get("python") != sys.implementation.cache_tag:
        return Build(False, f"pure Python (compiled for {stamp.get('python')}, "
                            f"running {sys.implementation.cache_tag})")
    sources = stamp.get("sources", {})
    changed = [m for m in modules
               if sources.get(m) != source_digest(directory / f"{m}.py")]
    if changed:
        return Build(False, "pure Python (changed since the compiled build: " +
                     ", ".join(f"{m}.py" for m in changed) + "; run `make setup` to rebuild)")
    missing = [m for m in modules if not any(
        (directory / f"{m}{suffix}").exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)]
    if missing:
        return Build(False, "pure Python (compiled modules missing: " + ", ".join(missing) + ")")
    return Build(True, f"compiled ({stamp.get('compiler', 'mypyc')})")


class SourceFirst:
    """A meta-path finder that loads the listed edge modules from their `.py` files."""

    def __init__(self, directory: Path, modules: Sequence[str]) -> None:
        self.paths = {f"edge.{m}": directory / f"{m}.py" for m in modules}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        source = self.paths.get(fullname)
        if source is None:
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def activate() -> Build:
    """Called once, when the `edge` package is imported."""
    build = check()
    if not build.native and not any(isinstance(f, SourceFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, SourceFirst(PACKAGE_DIR, COMPILED))
    return build
