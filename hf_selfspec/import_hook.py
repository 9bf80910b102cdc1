"""Run a callback once a module has been imported, without importing it: at once when it is
already loaded, else right after its first import (a finder at the front of sys.meta_path
that wraps that one module's loader, then removes itself).

Used to install the attach-first check on HF's generate (integration/generate.py) as soon as
`transformers.generation.utils` is loaded, so that importing hf_selfspec does not pull in
HF's generation stack (~1.5 s) and a model never attached still gets the clear error.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable


def after_import(name: str, callback: Callable[[], None]) -> None:
    """callback() now if module `name` is loaded, else once its first import has run."""
    if name in sys.modules:
        callback()
        return
    sys.meta_path.insert(0, _Finder(name, callback))


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[], None]):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once; the other finders find the real module
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenCall(spec.loader, self.callback)
        return spec


class _ThenCall(importlib.abc.Loader):
    """The module's own loader, then the callback; anything else asked of it (get_source,
    resource readers, ...) is the wrapped loader's answer."""

    def __init__(self, loader, callback: Callable[[], None]):
        self._loader, self._callback = loader, callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._callback()

    def __getattr__(self, name):
        return getattr(self._loader, name)
