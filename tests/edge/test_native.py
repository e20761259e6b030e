"""The compiled build is used only while it matches the sources; otherwise the sources run."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import edge
from edge import native

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
MODULES = ("alpha", "beta")


def built(tmp_path: Path) -> Path:
    """A package directory as `tools/build_edge.py` leaves it."""
    for m in MODULES:
        (tmp_path / f"{m}.py").write_text(f"NAME = {m!r}\n")
        (tmp_path / f"{m}{SUFFIX}").write_bytes(b"\x7fELF")
    stamp = native.stamp_for(tmp_path, MODULES, "mypyc test")
    (tmp_path / native.STAMP.name).write_text(json.dumps(stamp))
    return tmp_path


def test_a_build_matching_its_sources_is_used(tmp_path: Path) -> None:
    build = native.check(built(tmp_path), MODULES, environ={})
    assert build == native.Build(True, "compiled (mypyc test)")


def test_a_changed_source_sends_the_edge_back_to_the_sources(tmp_path: Path) -> None:
    directory = built(tmp_path)
    (directory / "beta.py").write_text("NAME = 'edited'\n")
    build = native.check(directory, MODULES, environ={})
    assert not build.native
    assert "beta.py" in build.detail and "alpha.py" not in build.detail


def test_no_stamp_means_not_compiled(tmp_path: Path) -> None:
    directory = built(tmp_path)
    (directory / native.STAMP.name).unlink()
    build = native.check(directory, MODULES, environ={})
    assert not build.native and "not compiled" in build.detail


def test_a_damaged_stamp_means_not_compiled(tmp_path: Path) -> None:
    directory = built(tmp_path)
    (directory / native.STAMP.name).write_text("{not json")
    assert not native.check(directory, MODULES, environ={}).native


def test_a_missing_extension_means_not_compiled(tmp_path: Path) -> None:
    directory = built(tmp_path)
    (directory / f"alpha{SUFFIX}").unlink()
    build = native.check(directory, MODULES, environ={})
    assert not build.native and "alpha" in build.detail


def test_a_build_for_another_interpreter_is_not_used(tmp_path: Path) -> None:
    directory = built(tmp_path)
    stamp = json.loads((directory / native.STAMP.name).read_text())
    stamp["python"] = "cpython-399"
    (directory / native.STAMP.name).write_text(json.dumps(stamp))
    build = native.check(directory, MODULES, environ={})
    assert not build.native and "cpython-399" in build.detail


def test_the_environment_can_ask_for_the_sources(tmp_path: Path) -> None:
    directory = built(tmp_path)
    assert not native.check(directory, MODULES, environ={"MERIDIAN_EDGE_PURE": "1"}).native
    assert native.check(directory, MODULES, environ={"MERIDIAN_EDGE_PURE": "0"}).native


def test_the_source_finder_serves_only_the_listed_modules(tmp_path: Path) -> None:
    finder = native.SourceFirst(built(tmp_path), MODULES)
    spec = finder.find_spec("edge.alpha")
    assert spec is not None and spec.origin == str(tmp_path / "alpha.py")
    assert finder.find_spec("edge.gamma") is None
    assert finder.find_spec("alpha") is None


def loaded_from(env: dict[str, str]) -> dict[str, str]:
    code = ("import json, importlib, edge\n"
            "from edge import native\n"
            "print(json.dumps({m: importlib.import_module('edge.' + m).__file__ "
            "for m in native.COMPILED}))")
    root = Path(edge.__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_running_edge_loads_what_its_build_says() -> None:
    """Every module on the request path comes from the build when it is in use, and from
    its source otherwise, including when the environment asks for the sources."""
    files = loaded_from(dict(os.environ))
    expected = SUFFIX if edge.BUILD.native else ".py"
    assert all(path.endswith(expected) for path in files.values()), files
    pure = loaded_from({**os.environ, "MERIDIAN_EDGE_PURE": "1"})
    assert all(path.endswith(".py") for path in pure.values()), pure


def test_no_compiled_function_binds_one_name_to_two_exception_types() -> None:
    """mypyc types an `except ... as name` variable by its first clause, so a second clause
    binding the same name to another type fails at run time (TypeError) in the compiled
    edge only; each clause needs its own name."""
    import ast

    clashes = []
    for module in native.COMPILED:
        tree = ast.parse((native.PACKAGE_DIR / f"{module}.py").read_text())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            bound: dict[str, set[str]] = {}
            for node in ast.walk(function):
                if isinstance(node, ast.ExceptHandler) and node.name and node.type:
                    bound.setdefault(node.name, set()).add(ast.unparse(node.type))
            clashes += [f"{module}.{function.name}: {name} {sorted(types)}"
                        for name, types in bound.items() if len(types) > 1]
    assert clashes == []
