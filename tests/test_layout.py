"""The package's shape: no import cycles, the kernels shipped as hf_selfspec.kernels from the
top-level kernels/ folder, and no top-level module named `kernels` (Hugging Face's own
`kernels` package has that name and transformers imports it when installed)."""

from __future__ import annotations

import ast
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


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the package that `name` imports, anywhere in its file (a function-level
    import is still a dependency; an `if TYPE_CHECKING:` import, for annotations only, is not)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
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
    """Every node outside `if TYPE_CHECKING:` blocks."""
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


def test_package_import_graph_is_acyclic():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_pyproject_ships_every_package_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"hf_selfspec.kernels": "kernels"}
    folders = {".".join(["hf_selfspec", *p.parent.relative_to(ROOT / "hf_selfspec").parts])
               for p in (ROOT / "hf_selfspec").rglob("__init__.py")}
    folders = {f.rstrip(".") for f in folders} | {"hf_selfspec.kernels"}
    assert set(config["packages"]) == folders


def test_no_top_level_kernels_module():
    """Importing the package and its kernels never binds the top-level name `kernels`."""
    code = ("import sys, hf_selfspec, hf_selfspec.kernels, hf_selfspec.kernels.cpu_rows; "
            "assert 'kernels' not in sys.modules, sys.modules.get('kernels'); "
            "assert hf_selfspec.kernels.__file__.endswith('kernels/__init__.py')")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT / "tests")
    assert not (ROOT / "hf_selfspec" / "kernels").exists()  # one home for the kernels
