"""Moved: the CUDA-graph executor is `hf_selfspec.engine.cuda_graphs` (this name is kept
only until every importer outside the package's tracked files has moved)."""

from .cuda_graphs import CudaGraphRunner, graphs_by_default, resolve_executor  # noqa: F401
