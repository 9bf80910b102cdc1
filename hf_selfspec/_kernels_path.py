"""Make `hf_selfspec.kernels` importable however the package is installed.

The kernels live in the repository's top-level `kernels/` folder: ``attention.row_attention``
(Triton) and ``reference.row_attention_reference`` (PyTorch) compute decode attention whose
per-row result does not depend on how many rows share the call (importing them does not
import Triton; the launcher does so on first use); ``cpu_rows.load_rows_linear()`` compiles
(once per machine) the CPU row kernel, x @ W^T with a row's result independent of the other
rows.

The folder has no ``__init__.py`` on purpose: from the repository root ('' on sys.path) a
regular package named `kernels` would shadow Hugging Face's own `kernels` package, which
transformers imports at start-up. A folder without ``__init__.py`` is at most a namespace
portion, and Python prefers any regular package of that name anywhere on sys.path over it.

A wheel ships the folder as the namespace subpackage ``hf_selfspec/kernels/`` (pyproject
`package-dir`), found by the normal import machinery. A source tree used without installing
(a Space running `app.py`, `PYTHONPATH=.`) and an editable install (setuptools' editable
finder only maps folders that hold an ``__init__.py``) do not find it, so the folder is
registered here as the namespace package ``hf_selfspec.kernels``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def _register_source_kernels() -> None:
    name = "hf_selfspec.kernels"
    if name in sys.modules or importlib.util.find_spec(name) is not None:
        return
    folder = Path(__file__).resolve().parent.parent / "kernels"
    if not (folder / "cpu_rows.py").is_file():
        return  # not a source tree: the import error will name the missing module
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    module = importlib.util.module_from_spec(spec)  # a namespace package: nothing to execute
    sys.modules[name] = module
    # bind it on the parent as the import system does, so `hf_selfspec.kernels` resolves
    sys.modules["hf_selfspec"].kernels = module


_register_source_kernels()
