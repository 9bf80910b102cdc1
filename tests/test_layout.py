"""The package's shape: no import cycles (TYPE_CHECKING imports included), the kernels shipped as
hf_selfspec.kernels from the top-level kernels/ folder, and no top-level module named `kernels` (Hugging Face's own
`kernels` package has that name and transformers imports it when installed)."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# where each shipped package's files live (pyproject's package-dir maps hf_selfspec.kernels)
PACKAGE_DIRS = {"hf_selfspec": ROOT / "hf_selfspec", "hf_selfspec.kernels": ROOT / "kernels"}


def _modules() -> dict[str, Path]:
    """Every module of the shipped package: dotted name -> file."""
    modules = {}
    for base, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([base, *parts])
            if base == "hf_selfspec" and parts[:1] == ["kernels"]:
                continue
            modules[name] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path], type_checking: bool = True) -> set[str]:
    """Modules of the package that `name` imports, anywhere in its file: a function-level
    import is still a dependency, and so is an `if TYPE_CHECKING:` import (for annotations
    only, but a module that annotates against another depends on it: a circle through
    annotations is still a circle; type_checking=False leaves those out)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in (ast.walk(tree) if type_checking else _runtime_nodes(tree)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        found.update(t for t in targets if t in modules and t != name)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node outside `if TYPE_CHECKING:` blocks (the imports that run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None) if isinstance(child, ast.If) else None
            if test is not None and "TYPE_CHECKING" in ast.unparse(test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _import_cycle(type_checking: bool) -> list[str] | None:
    """The first import cycle of the package's modules (None: there is none)."""
    modules = _modules()
    graph = {name: _imports(name, path, modules, type_checking) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep, path + [dep])
                if cycle is not None:
                    return cycle
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name, [name])
            if cycle is not None:
                return cycle
    return None


def test_package_import_graph_is_acyclic():
    """No module imports one that imports it back, TYPE_CHECKING imports included."""
    cycle = _import_cycle(type_checking=True)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_sees_type_checking_imports(tmp_path, monkeypatch):
    """A circle closed only by an `if TYPE_CHECKING:` import is found (and not when those
    imports are left out)."""
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n")
    monkeypatch.setattr(sys.modules[__name__], "_modules", lambda: {"fake.a": tmp_path / "a.py",
                                                                    "fake.b": tmp_path / "b.py"})
    assert _import_cycle(type_checking=True) == ["fake.a", "fake.b", "fake.a"]
    assert _import_cycle(type_checking=False) is None


def test_pyproject_ships_every_package_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"hf_selfspec.kernels": "kernels"}
    # every folder of the package, code or data (a data folder left out of `packages` makes
    # setuptools warn that it "would be ignored"), plus the kernels mapped from kernels/
    folders = {".".join(["hf_selfspec", *p.relative_to(ROOT / "hf_selfspec").parts])
               for p in (ROOT / "hf_selfspec").rglob("*")
               if p.is_dir() and p.name != "__pycache__"}
    folders |= {"hf_selfspec", "hf_selfspec.kernels"}
    assert set(config["packages"]) == folders


def test_no_top_level_kernels_module():
    """Importing the package and its kernels never binds the top-level name `kernels`."""
    code = ("import sys, hf_selfspec, hf_selfspec.kernels, hf_selfspec.kernels.cpu_rows; "
            "assert 'kernels' not in sys.modules, sys.modules.get('kernels'); "
            "assert hf_selfspec.kernels.cpu_rows.__file__.endswith('kernels/cpu_rows.py')")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT / "tests")
    assert not (ROOT / "hf_selfspec" / "kernels").exists()  # one home for the kernels


# Run from the repository root, where '' on sys.path puts the top-level kernels/ folder
# ahead of site-packages. Prints whether `kernels` resolved to a regular package (a file
# origin), the module transformers imported and whether transformers took it for HF's package.
_ROOT_IMPORT = """
import importlib.util, sys
spec = importlib.util.find_spec("kernels")
origin = spec.origin if spec is not None else None
import transformers
import transformers.integrations.hub_kernels  # imports HF's kernels when it is available
from transformers.utils.import_utils import is_kernels_available
import hf_selfspec, hf_selfspec.kernels.cpu_rows
loaded = getattr(sys.modules.get("kernels"), "__file__", None)
print(origin, loaded, is_kernels_available(), sep="\\n")
"""


def test_repository_root_never_shadows_hf_kernels():
    """`import transformers` from the repository root works with or without Hugging Face's
    `kernels` package installed (transformers >= 5.25 imports it at start-up): the folder
    kernels/ has no __init__.py, so it is never a regular top-level package `kernels`;
    without HF's package it is a namespace portion, which transformers reports as absent."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    try:
        importlib.metadata.distribution("kernels")
        hf_kernels = True
    except importlib.metadata.PackageNotFoundError:
        hf_kernels = False
    out = subprocess.run([sys.executable, "-c", _ROOT_IMPORT], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.splitlines()[-3:]
    origin, loaded, available = out
    ours = str(ROOT / "kernels")
    assert not origin.startswith(ours) and not loaded.startswith(ours), out
    if hf_kernels:  # HF's package wins over the namespace portion and is the one imported
        assert origin != "None", out
    else:  # at most a namespace portion (origin None), never reported as HF's package
        assert origin == "None" and available == "False", out


def test_pyproject_metadata_builds_without_setuptools_warnings():
    """What setuptools warns about at `pip install` (a TOML-table license is deprecated) and
    what a user's Python must be (the pinned numpy needs 3.11); the version is written once."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str)  # an SPDX expression
    assert project["project"]["requires-python"] == ">=3.11"
    assert project["project"]["dynamic"] == ["version"] and "version" not in project["project"]
    version = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert version == "hf_selfspec._version.__version__"
