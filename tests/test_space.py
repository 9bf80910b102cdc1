"""The demo as a Hugging Face Space (docs/space.md): README front matter, requirements.txt
and the upload selection of scripts/push_space.sh.

The start from scratch (a fresh venv from requirements.txt alone, app.py started headless
from the uploaded files only) takes minutes, over a CI test's budget: it is
scripts/check_space.sh, run by hand, its figures in docs/space.md."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml
from hf_selfspec.kernels.cpu_rows import SECTIONS

ROOT = Path(__file__).resolve().parent.parent
# import name -> the distribution requirements.txt must name
DISTRIBUTIONS = {"gradio": "gradio", "torch": "torch", "transformers": "transformers",
                 "hf_selfspec": None}  # hf_selfspec: the source tree itself, its deps below


def front_matter() -> dict:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.match(r"---\n(.*?)\n---\n", text, re.DOTALL)
    assert match, "README.md has no YAML front matter"
    return yaml.safe_load(match.group(1))


def requirements() -> dict[str, str]:
    """name (lower case, '_' as '-') -> the line's specifier ('' if none)."""
    out = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line or line.startswith("-"):
            continue
        name, spec = re.match(r"([A-Za-z0-9_.\-]+)(.*)", line).groups()
        out[name.lower().replace("_", "-")] = spec.strip()
    return out


def space_files() -> list[str]:
    listing = subprocess.run(["bash", "scripts/push_space.sh", "--list"], cwd=ROOT, check=True,
                             capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    return listing.stdout.split()


def test_front_matter_builds_a_cpu_space():
    meta = front_matter()
    assert meta["sdk"] == "gradio" and (ROOT / meta["app_file"]).is_file()
    major, minor = (int(v) for v in str(meta["python_version"]).split(".")[:2])
    assert (major, minor) >= (3, 11)  # numpy 2.4 needs 3.11
    pinned = requirements()["gradio"]
    assert pinned == f"=={meta['sdk_version']}", "requirements.txt must pin gradio to sdk_version"
    try:
        installed = version("gradio")
    except PackageNotFoundError:
        installed = None  # the browser test's set-up installs it; the pin is checked above
    if installed is not None:
        assert installed == meta["sdk_version"], "the tested gradio is not the Space's"


def test_requirements_cover_what_app_imports():
    """ninja (the C++ row kernel), every top-level import of app.py and every dependency of
    the hf_selfspec package it imports from the source tree, each pinned."""
    reqs = requirements()
    assert "ninja" in reqs
    tree = ast.parse((ROOT / "app.py").read_text())
    imported = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in tree.body
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    third_party = imported - set(sys.stdlib_module_names) - {"__future__"}
    assert third_party <= DISTRIBUTIONS.keys(), f"map {third_party - DISTRIBUTIONS.keys()} here"
    needed = {d for d in (DISTRIBUTIONS[m] for m in third_party) if d}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed |= {re.match(r"[A-Za-z0-9_.\-]+", d).group(0).lower().replace("_", "-")
               for d in pyproject["project"]["dependencies"]}
    assert needed <= reqs.keys(), f"requirements.txt lacks {sorted(needed - reqs.keys())}"
    assert all(reqs[name].startswith("==") for name in needed), "pin what the Space installs"


def test_upload_selects_what_the_space_needs_and_nothing_else():
    files = space_files()
    kernel = [f"kernels/cpu-rows/{name}" for name in SECTIONS] + ["kernels/cpu_states.cpp"]
    for needed in ("app.py", "requirements.txt", "README.md", *kernel,
                   "hf_selfspec/default_heads/heads.safetensors",
                   "hf_selfspec/model_cards/top_heads_card.md.j2"):
        assert needed in files, needed
    package = {str(p.relative_to(ROOT)) for p in (ROOT / "hf_selfspec").rglob("*.py")
               if "__pycache__" not in p.parts}
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split())
    assert package & tracked <= set(files)
    assert not [f for f in files if f.startswith(("tests/", "docs/", "scripts/", ".venv"))]



def test_app_without_gradio_says_how_to_install_it():
    """setup.sh installs no gradio: app.py then stops with one line saying how to get it."""
    code = "import runpy, sys; sys.modules['gradio'] = None; runpy.run_path('app.py', run_name='__main__')"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "app.py needs gradio" in result.stderr and "requirements.txt" in result.stderr
