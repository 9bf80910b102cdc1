"""Make `hf_selfspec.kernels` importable when the package runs from a source checkout.

The kernels live in the repository's top-level `kernels/` folder and ship inside the wheel
as `hf_selfspec.kernels` (pyproject `package-dir`; an editable install maps it the same way).
A source tree used without installing (a Space running `app.py`, `PYTHONPATH=.`) has no
such mapping, so the folder is registered here. No top-level module named `kernels` is
ever imported: that name belongs to Hugging Face's `kernels` package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _register_source_kernels() -> None:
    name = "hf_selfspec.kernels"
    if name in sys.modules or importlib.util.find_spec(name) is not None:
        return
    folder = Path(__file__).resolve().parent.parent / "kernels"
    init = folder / "__init__.py"
    if not init.is_file():
        return  # nothing to register: the import error will name the missing module
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


_register_source_kernels()
