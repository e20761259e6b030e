"""Compile the edge's request path to C with mypyc, in place beside the sources.

    python tools/build_edge.py            # build (about 30 s on 2 cores)
    python tools/build_edge.py --clean    # remove the build; the edge then runs from source

The modules are those in `edge.native.COMPILED`. The extensions land beside their `.py`
files, with one shared library (`edge/_native__mypyc…so`) and a stamp (`edge/_native.json`)
recording the digest of each source compiled. `edge.native` uses the build only while every
one of those sources is unchanged, so editing the edge without rebuilding is safe.

A failed build leaves nothing behind (the edge then runs from source) and exits non-zero;
`make setup` reports it and carries on.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge import native  # noqa: E402 - after the path above

SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def log(message: str) -> None:
    print(f"[build_edge] {message}", flush=True)


def outputs() -> list[Path]:
    found = [native.STAMP]
    for path in native.PACKAGE_DIR.iterdir():
        if path.name.endswith(SUFFIXES):
            found.append(path)
    return [p for p in found if p.exists()]


def clean() -> None:
    for path in outputs():
        path.unlink()


def compiler_version() -> str:
    from importlib.metadata import version

    return f"mypyc {version('mypy')}"


def build(jobs: int) -> None:
    from mypyc.build import mypycify
    from setuptools import setup

    sources = [f"edge/{m}.py" for m in native.COMPILED]
    with tempfile.TemporaryDirectory(prefix="meridian-edge-build-") as tmp:
        log(f"translating {len(sources)} modules to C (mypyc, type-checks them first)")
        started = time.monotonic()
        os.chdir(ROOT)
        # The edge's own mypy settings, not the project's: those load the Django plugins,
        # which an edge host does not install (`pip install '.[edge]'`).
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
        built = sorted((Path(tmp) / "lib" / "edge").iterdir())
        for path in built:
            shutil.copy2(path, native.PACKAGE_DIR / path.name)
        log(f"  done in {time.monotonic() - started:.1f}s ({len(built)} files)")
    stamp = native.stamp_for(native.PACKAGE_DIR, native.COMPILED, compiler_version())
    native.STAMP.write_text(json.dumps(stamp, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clean", action="store_true", help="remove the build and stop")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    clean()
    if args.clean:
        log("removed the compiled edge; it runs from source")
        return 0
    started = time.monotonic()
    try:
        build(args.jobs)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure leaves the sources in charge
        clean()
        log(f"FAILED ({type(exc).__name__}: {exc}); the edge will run from source")
        return 1
    result = native.check(environ={})
    if not result.native:
        clean()
        log(f"FAILED: the build is not usable: {result.detail}")
        return 1
    log(f"edge {result.detail} in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
