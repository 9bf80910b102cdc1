"""Moved: the engine is `hf_selfspec.engine.core` (this name is kept only until every
importer outside the package's tracked files has moved; import from core.py)."""

from .core import *
from .core import __all__  # noqa: F401
