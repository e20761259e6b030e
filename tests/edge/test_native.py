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


def built(tmp_path: Path) -> tuple[Path, Path]:
    """A package directory and its build directory as `tools/build_edge.py` leaves them."""
    package, build = tmp_path / "edge", tmp_path / "edge" / "_build"
    build.mkdir(parents=True)
    for m in (*MODULES, "helper"):
        (package / f"{m}.py").write_text(f"NAME = {m!r}\n")
    for name in native.binary_names(MODULES):
        (build / name).write_bytes(b"\x7fELF " + name.encode())
    stamp = native.stamp_for(native.source_digests(package), build, MODULES, "mypyc test")
    (build / native.STAMP_NAME).write_text(json.dumps(stamp))
    return package, build


def check(package: Path, **env: str) -> native.Build:
    return native.check(package, modules=MODULES, environ=env)


def test_a_build_matching_its_sources_is_used(tmp_path: Path) -> None:
    package, _ = built(tmp_path)
    assert check(package) == native.Build(True, "compiled (mypyc test)")


def test_any_changed_added_or_removed_source_sends_the_edge_back_to_the_sources(
        tmp_path: Path) -> None:
    package, _ = built(tmp_path)
    (package / "beta.py").write_text("NAME = 'edited'\n")
    build = check(package)
    assert not build.native and "beta.py" in build.detail and "alpha.py" not in build.detail
    package, _ = built(tmp_path / "2")
    (package / "helper.py").write_text("# not compiled, but compiled code is checked against it\n")
    assert "helper.py" in check(package).detail
    package, _ = built(tmp_path / "3")
    (package / "new.py").write_text("")
    assert "new.py" in check(package).detail
    package, _ = built(tmp_path / "4")
    (package / "helper.py").unlink()
    assert "helper.py" in check(package).detail


def test_a_missing_or_damaged_compiled_file_is_not_used(tmp_path: Path) -> None:
    package, build = built(tmp_path)
    (build / f"_native__mypyc{SUFFIX}").unlink()  # the shared library holding the code
    assert "missing: _native__mypyc" in check(package).detail
    package, build = built(tmp_path / "2")
    (build / f"alpha{SUFFIX}").write_bytes(b"\x7fELF half-written")
    assert "damaged: alpha" in check(package).detail


def test_no_stamp_a_damaged_one_a_failed_or_removed_build_mean_sources(tmp_path: Path) -> None:
    package, build = built(tmp_path)
    stamp = build / native.STAMP_NAME
    for text, why in (("{not json", "not compiled"), ("[1, 2]", "damaged"),
                      ('{"python": "x"}', "compiled for x"),
                      ('{"failed": "gcc: not found"}', "the build failed: gcc: not found"),
                      ('{"disabled": true}', "make edge-pure")):
        stamp.write_text(text)
        build_state = check(package)
        assert not build_state.native and why in build_state.detail, (text, build_state)
    stamp.unlink()
    assert "not compiled" in check(package).detail


def test_a_stamp_for_other_modules_or_another_interpreter_is_not_used(tmp_path: Path) -> None:
    package, build = built(tmp_path)
    stamp = json.loads((build / native.STAMP_NAME).read_text())
    (build / native.STAMP_NAME).write_text(json.dumps({**stamp, "modules": ["alpha"]}))
    assert "damaged" in check(package).detail
    (build / native.STAMP_NAME).write_text(json.dumps({**stamp, "python": "cpython-399"}))
    assert "cpython-399" in check(package).detail


def test_the_environment_can_ask_for_the_sources(tmp_path: Path) -> None:
    package, _ = built(tmp_path)
    assert not check(package, MERIDIAN_EDGE_PURE="1").native
    assert check(package, MERIDIAN_EDGE_PURE="0").native


def test_the_native_finder_serves_only_the_build(tmp_path: Path) -> None:
    _, build = built(tmp_path)
    finder = native.NativeFirst(build, MODULES)
    spec = finder.find_spec("edge.alpha")
    assert spec is not None and spec.origin == str(build / f"alpha{SUFFIX}")
    assert isinstance(spec.loader, importlib.machinery.ExtensionFileLoader)
    group = finder.find_spec("edge._native__mypyc")
    assert group is not None and group.origin == str(build / f"_native__mypyc{SUFFIX}")
    assert finder.find_spec("edge.helper") is None and finder.find_spec("alpha") is None


def test_nothing_compiled_lies_beside_the_sources() -> None:
    """Python would load an extension beside a source without asking the stamp."""
    assert list(native.PACKAGE_DIR.glob(f"*{SUFFIX}")) == []


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
    for path in files.values():
        if edge.BUILD.native:
            # (mypyc names the file of a module first imported from within the shared
            # library as if it sat in a subfolder of the build; it is still the build's.)
            assert path.startswith(str(native.BUILD_DIR) + os.sep), files
            assert path.endswith(SUFFIX), files
        else:
            assert path.endswith(".py"), files
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
