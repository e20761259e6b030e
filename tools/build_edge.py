"""Compile the edge's request path to C with mypyc, into `edge/_build/`.

    python tools/build_edge.py            # build (about 35 s on 2 cores)
    python tools/build_edge.py --clean    # remove the build; the edge runs from source
    python tools/build_edge.py --no-cache # compile even if ~/.cache/meridian/edge has it

A build is kept per machine in `~/.cache/meridian/edge/<key>` (MERIDIAN_CACHE_DIR), keyed by
the SHA-256 of every source, the compiler and Python: another clone of the same sources
copies it (and checks it, as any build) instead of compiling again.

The modules are those in `edge.native.COMPILED`. The build is made in a temporary directory
and swapped in whole (a rename), with a stamp holding the SHA-256 of every source of the
package, taken before compiling and checked again after, and of every file built;
`edge.native` uses the build only while all of them still match. A source saved during the
build fails it rather than leaving old code stamped as new.

A failed build leaves a stamp that says so (the edge then runs from source, and `make` does
not retry until a source changes) and exits non-zero. `--clean` leaves a stamp saying the
build was removed on purpose, so `make setup` does not put it back; `make edge-native`
builds again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge import native  # noqa: E402 - after the path above


def log(message: str) -> None:
    print(f"[build_edge] {message}", flush=True)


def remove_legacy() -> None:
    """Extensions an older layout left beside the sources, where Python would prefer them."""
    for path in native.PACKAGE_DIR.glob(f"*{native.EXTENSION_SUFFIX}"):
        path.unlink()
    (native.PACKAGE_DIR / "_native.json").unlink(missing_ok=True)


def install(new_dir: Path) -> None:
    """Swap `new_dir` in as the build directory: an edge starting meanwhile finds the old
    build, none, or the new one, never a mix, and running edges keep the files they loaded."""
    old = native.BUILD_DIR.with_name(f"{native.BUILD_DIR.name}.old-{os.getpid()}")
    if native.BUILD_DIR.exists():
        native.BUILD_DIR.rename(old)
    new_dir.rename(native.BUILD_DIR)
    shutil.rmtree(old, ignore_errors=True)


def new_build_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="_build.new-", dir=native.PACKAGE_DIR))


def write_stamp(directory: Path, stamp: dict[str, Any]) -> None:
    (directory / native.STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")


def write_stamp_only(stamp: dict[str, Any]) -> None:
    """A build of nothing but its stamp: failed, or removed on purpose."""
    new_dir = new_build_dir()
    write_stamp(new_dir, stamp)
    install(new_dir)


def compiler_version() -> str:
    from importlib.metadata import version

    return f"mypyc {version('mypy')}"


def cache_dir(digests: dict[str, str]) -> Path:
    """Where this machine keeps the build of exactly these sources with this compiler and
    Python (like `make engine`'s cache): a second clone of the same commit copies it instead
    of compiling for a minute."""
    base = Path(os.environ.get("MERIDIAN_CACHE_DIR") or Path.home() / ".cache" / "meridian")
    key = hashlib.sha256(json.dumps(
        [sorted(digests.items()), compiler_version(), sys.version, sysconfig.get_platform(),
         native.EXTENSION_SUFFIX]).encode()).hexdigest()[:32]
    return base / "edge" / key


def from_cache(cached: Path, new_dir: Path) -> bool:
    names = native.binary_names()
    if not all((cached / name).is_file() for name in names):
        return False
    for name in names:
        shutil.copy2(cached / name, new_dir / name)
    return True


def save_to_cache(new_dir: Path, cached: Path) -> None:
    """Best effort: a full or read-only cache only means the next clone compiles again."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".new-", dir=cached.parent))
    except OSError:
        return
    try:
        for name in native.binary_names():
            shutil.copy2(new_dir / name, staging / name)
        staging.rename(cached)  # whole or not at all; another build that got there first wins
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def build(jobs: int, use_cache: bool = True) -> str:
    from mypyc.build import mypycify
    from setuptools import setup

    sources = [f"edge/{m}.py" for m in native.COMPILED]
    digests = native.source_digests()
    new_dir = new_build_dir()
    cached = cache_dir(digests)
    if use_cache and from_cache(cached, new_dir):
        log(f"the build of these sources from {cached}")
        write_stamp(new_dir, native.stamp_for(digests, new_dir, native.COMPILED,
                                             compiler_version()))
        install(new_dir)
        result = native.check(environ={})
        if result.native:
            return f"{result.detail} (cached)"
        log(f"the cached build is not usable ({result.detail}); compiling")
        shutil.rmtree(cached, ignore_errors=True)
        new_dir = new_build_dir()
    try:
        with tempfile.TemporaryDirectory(prefix="meridian-edge-build-") as tmp:
            log(f"translating {len(sources)} modules to C (mypyc, type-checks them first)")
            started = time.monotonic()
            os.chdir(ROOT)
            # The edge's own mypy settings, not the project's: those load the Django
            # plugins, which an edge host does not install (`pip install -e '.[edge]'`).
            config = Path(tmp) / "mypy.ini"
            config.write_text("[mypy]\nignore_missing_imports = True\n")
            extensions = mypycify(["--config-file", str(config), *sources],
                                  only_compile_paths=sources, opt_level="3",
                                  group_name=native.GROUP, target_dir=str(Path(tmp) / "c"))
            log(f"  done in {time.monotonic() - started:.1f}s; compiling {len(extensions)} "
                f"extension(s) with {jobs} job(s)")
            started = time.monotonic()
            os.chdir(tmp)  # away from the project's pyproject.toml: this is no package build
            setup(name="meridian-edge-native", ext_modules=extensions, script_args=[
                "-q", "build_ext", "--build-temp", "obj", "--build-lib", "lib",
                "--parallel", str(jobs)])
            os.chdir(ROOT)
            for name in native.binary_names():
                shutil.copy2(Path(tmp) / "lib" / "edge" / name, new_dir / name)
            log(f"  done in {time.monotonic() - started:.1f}s")
        if native.source_digests() != digests:
            raise RuntimeError("a source changed during the build; build again")
        write_stamp(new_dir, native.stamp_for(digests, new_dir, native.COMPILED,
                                             compiler_version()))
        install(new_dir)
    except BaseException:
        shutil.rmtree(new_dir, ignore_errors=True)
        raise
    result = native.check(environ={})
    if not result.native:
        raise RuntimeError(f"the build is not usable: {result.detail}")
    if use_cache:
        save_to_cache(native.BUILD_DIR, cached)
    return result.detail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clean", action="store_true", help="remove the build and stop")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-cache", action="store_true",
                        help="compile even where this machine has a build of these sources")
    args = parser.parse_args()
    remove_legacy()
    if args.clean:
        write_stamp_only({"disabled": True})
        log("removed the compiled edge; it runs from source until `make edge-native`")
        return 0
    started = time.monotonic()
    try:
        detail = build(args.jobs, use_cache=not args.no_cache)
    except KeyboardInterrupt:
        log("interrupted; the previous build, if any, is unchanged")
        return 130
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure leaves the sources in charge
        reason = (f"mypyc or the C compiler stopped (exit {exc.code}); see its messages"
                  if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"[:500])
        write_stamp_only({"failed": reason})
        log(f"FAILED ({reason}); the edge runs from source. `make edge-native` tries again.")
        return 1
    log(f"edge {detail} in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
