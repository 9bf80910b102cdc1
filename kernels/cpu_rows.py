"""Row-invariant kernels for the CPU engine (see cpu_rows.cpp): `rows_linear(x, w)` =
x @ w^T, `rows_attention(q, k, v, limit, scale)` and a whole decoder layer built from them,
`rows_layer`, each computed so that a row's result is bit-identical whatever the other rows.

The C++ source is compiled once per machine with torch's own extension builder (ninja +
the system C++ compiler; ~45 s, cached under ~/.cache/torch_extensions) the first time
`load_rows_linear()` is called; `scripts/setup.sh` does it at install time. Needs an
x86-64 CPU with AVX2 and FMA and float32 tensors; where it cannot be built,
`load_rows_linear()` returns None and says why in `build_error()`, and the engine uses
another row layout.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_rows.cpp")
_error: str | None = None


def cpu_supports_kernel() -> bool:
    """AVX2 + FMA (torch reports AVX2 or AVX512 capability on such x86-64 CPUs)."""
    try:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    except Exception:  # noqa: BLE001 (old torch without the query)
        return False


@functools.lru_cache(maxsize=1)
def _load_module():
    """The compiled extension, or None when this machine cannot build or run it."""
    global _error
    if not cpu_supports_kernel():
        _error = f"the CPU lacks AVX2/FMA (torch capability {torch.backends.cpu.get_cpu_capability()!r})"
        return None
    path = os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load_inline

        # Always the ninja installed with this Python (the `ninja` dependency) when there is
        # one: ninja versions hash a build command differently, so a system ninja found
        # first on PATH in one process (venv not activated) and the venv's in another
        # would each rebuild the kernel (~1 min) for the other.
        scripts = sysconfig.get_path("scripts")
        if scripts and (Path(scripts) / "ninja").exists():
            os.environ["PATH"] = scripts + os.pathsep + path
        flags = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
        module = load_inline(
            name="selfspec_cpu_rows", cpp_sources=[SOURCE.read_text()],
            functions=["rows_linear", "rows_attention", "rows_layer"],
            extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 (no compiler / ninja: another layout is used)
        _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
        return None
    finally:
        os.environ["PATH"] = path
    return module


def load_rows_linear():
    """The compiled `rows_linear(x [R, K], w [O, K]) -> [R, O]` (float32, contiguous), or
    None when this machine cannot build or run it (`build_error()` says why)."""
    module = _load_module()
    return None if module is None else module.rows_linear


def load_rows_attention():
    """The compiled `rows_attention(q [R, Hq, d], k [Hkv, S, d], v [Hkv, S, d], limit int64
    [R], scale, path int64 [R, P]) -> o [R, Hq * d]` (float32, contiguous): row r sees
    logical keys [0, limit[r]]; with P = 0 (`NO_PATH`) key j is slot j, otherwise the row's
    last c_r keys are its c_r path slots (draft trees; -1 pads: see cpu_rows.cpp).
    None when this machine cannot build or run it (`build_error()` says why)."""
    module = _load_module()
    return None if module is None else module.rows_attention


def load_rows_layer():
    """The compiled `rows_layer(h [R, H], weights, k_cache, v_cache, cos, sin, slots, limit,
    eps, scale, path) -> h after one Llama/Qwen3 decoder layer` (see cpu_rows.cpp), or None when
    this machine cannot build or run it (`build_error()` says why)."""
    module = _load_module()
    return None if module is None else module.rows_layer


# `path` argument of rows_attention / rows_layer for steps without a tree
NO_PATH = torch.zeros(0, 0, dtype=torch.long)


def build_error() -> str | None:
    """Why `load_rows_linear()` returned None (None when it built)."""
    return _error


def rows_linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64 (for tests: the kernel's error is fp32 rounding)."""
    return (x.double() @ w.double().t()).to(x.dtype)


def rows_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             limit: torch.Tensor, scale: float,
                             path: torch.Tensor | None = None) -> torch.Tensor:
    """What `rows_attention` computes, in float64 (for tests)."""
    R, Hq, d = q.shape
    group = Hq // k.shape[0]
    kk = k.double().repeat_interleave(group, 0)  # [Hq, S, d]
    vv = v.double().repeat_interleave(group, 0)
    scores = torch.einsum("rhd,hsd->rhs", q.double() * scale, kk)
    slots = torch.arange(k.shape[1])
    visible = torch.zeros(R, k.shape[1], dtype=torch.bool)
    for r in range(R):
        tree = [] if path is None or path.shape[1] == 0 else [int(s) for s in path[r] if s >= 0]
        visible[r] = slots <= int(limit[r]) - len(tree)
        visible[r, tree] = True
    hidden = ~visible  # [R, S]
    scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
    o = torch.einsum("rhs,hsd->rhd", scores.softmax(-1), vv)
    return o.reshape(R, Hq * d).to(q.dtype)
