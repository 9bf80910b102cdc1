"""Row-invariant kernels for the CPU engine (C++, in sections: cpu-rows/): `rows_linear(x, w)` =
x @ w^T, `rows_attention(q, k, v, limit, scale, path, base, softcap, window)` and a whole decoder layer built from them,
`rows_layer`, each computed so that a row's result is bit-identical whatever the other rows.

The C++ sections (`SECTIONS`, in cpu-rows/) and cpu_states.cpp are compiled together, as one
translation unit, once per machine and Python environment with torch's own extension builder
(ninja + the system C++ compiler; ~45 s, cached under ~/.cache/torch_extensions, see
`build_directory`; a one-line message says so) the first time `load_rows_linear()` is
called; `scripts/setup.sh` does it at install time. The builder writes the sources' text,
concatenated, into the build folder's main.cpp and rebuilds when that text changes, so an
edit to any section rebuilds the kernel. Needs an
x86-64 CPU with AVX2, FMA and F16C; where it cannot be built, `load_rows_linear()` returns
None and says why in `build_error()`, and the engine uses another row layout.

Dtypes: weights and the KV cache may be float32, bfloat16 or float16 (read as such and
widened to float32 in registers: a bf16 model reads half the bytes per step); activations
(x, q, h, cos, sin) are float32 and every result is float32 (x and q given in bf16 / fp16
are widened exactly first). A row's result is bit-identical whatever the other rows, in
every dtype. Every entry point checks its arguments and raises RuntimeError saying what
was wrong (dtype, device, contiguity, shape, empty size, a slot or limit outside the cache).

Build locks (`build_lock`): a process builds or loads the kernel holding an advisory lock
(flock) on `selfspec.owner` in the build folder, which the operating system releases when
the process ends, however it ends. torch's builder keeps its own lock, a plain file (`lock`)
that a killed build leaves behind and that torch then waits on for ever; it is only ever
made by a process holding ours, so a `lock` found once ours is held was left by a process
that is gone: it is taken over at once, with one warning, and a finished build is loaded
without waiting. (The one exception: an older hf_selfspec, which took no lock of ours,
building in the same environment at that very moment.) A live process holding ours (building, ~1 min)
is waited on, saying so at once (whose, where, for how long at most: `MAX_WAIT_SECONDS`); past that the kernel is not
loaded in this process (`build_error()` says so) and the engine uses another row layout.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch

# The row kernel's sections, in the order they are compiled: one translation unit, each
# section using what those before it declare (common.h says why one unit). A section file
# left out of this list is not compiled (tests/test_kernels_cpu.py checks the list against
# the folder); pyproject's package-data ships the folder. Its name is no Python identifier, so
# nothing takes it for a package: not the import system (beside this module of the same
# stem) nor setuptools (which warns of a package left out of `packages` otherwise).
SOURCE_DIR = Path(__file__).with_name("cpu-rows")
SECTIONS = ("common.h", "pool.h", "products.cpp", "compact.cpp", "linear.cpp", "transposed.cpp",
            "attention_math.cpp", "attention.cpp", "layers.cpp", "draft.cpp", "screen.cpp")
# the hybrids' recurrent state updates, built into the same extension (last)
STATES_SOURCE = Path(__file__).with_name("cpu_states.cpp")
SOURCES = tuple(SOURCE_DIR / name for name in SECTIONS) + (STATES_SOURCE,)
# the first section; engine/cache.py hashes it into its layout key (`source_digest()` covers
# every source)
SOURCE = SOURCES[0]
NAME = "selfspec_cpu_rows"
# a build takes ~1 min (a few on a loaded 2-core machine): a process still holding the build
# lock after this long is stuck, and this process goes on without the kernel
MAX_WAIT_SECONDS = 600.0
OWNER_FILE = "selfspec.owner"  # the flock'ed file of `build_lock`; holds its owner's pid
TORCH_LOCK_FILE = "lock"  # torch's builder's own lock file (torch.utils.file_baton)
_error: str | None = None


def kernel_sources() -> list[str]:
    """The text of every source of the extension (`SOURCES`), in compile order: what the
    build compiles, and what decides whether a built module is current (`_build_needed`)."""
    return [path.read_text() for path in SOURCES]


def source_digest() -> str:
    """A digest of every source of the extension (`SOURCES`, in order): it changes when any
    section changes."""
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_directory(name: str = NAME) -> Path:
    """The folder the extension `name` is built in, one per Python environment: under torch's
    extension folder (TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions/<python>_<accelerator>/),
    `<name>_<environment>`; created if missing. The build command names the environment's
    torch headers and ninja, so two virtual environments sharing one folder would each rebuild
    the kernel (~1 min, on an engine's first call) after the other had used it."""
    from torch.utils import cpp_extension

    environment = hashlib.sha256(f"{sys.prefix}|{torch.__file__}|{torch.__version__}".encode()).hexdigest()[:12]
    folder = f"{name}_{environment}"
    try:
        return Path(cpp_extension._get_build_directory(folder, False))
    except Exception:  # noqa: BLE001 (a torch without the private helper: its documented layout)
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
        path = Path(root) / folder
        path.mkdir(parents=True, exist_ok=True)
        return path


def _build_needed(folder: Path, sources: list[str]) -> bool:
    """Whether loading `sources` will compile: no built module in `folder`, or one built
    from other sources (torch's builder writes them, verbatim, into main.cpp)."""
    try:
        if not (folder / f"{NAME}.so").exists():
            return True
        built_from = (folder / "main.cpp").read_text()
    except OSError:
        return True
    return any(source not in built_from for source in sources)


class BuildLockTimeout(RuntimeError):
    """Another live process held the kernel's build lock longer than the wait allowed."""


@contextlib.contextmanager
def build_lock(folder: Path, max_wait: float = MAX_WAIT_SECONDS, poll: float = 0.1):
    """Hold the build lock of the extension built in `folder` (see the module docstring):
    at once where no live process holds it, else after a wait announced by one warning;
    raises BuildLockTimeout past `max_wait` seconds. Once held, torch's `lock` file there
    was left by a process that is gone: removed, with one warning. Without fcntl (not a
    POSIX system) nothing is locked and torch's own lock alone applies."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    owner = folder / OWNER_FILE
    fd = os.open(owner, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the compiler's processes
    try:
        if not _try_lock(fcntl, fd):
            _wait_for_lock(fcntl, fd, folder, _owner_pid(owner), max_wait, poll)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        torch_lock = folder / TORCH_LOCK_FILE
        if torch_lock.exists():
            warnings.warn(f"hf_selfspec: taking over the kernel build lock {torch_lock}: the process that left "
                          "it is gone (killed while building or loading the C++ row kernel)",
                          RuntimeWarning, stacklevel=3)
            with contextlib.suppress(FileNotFoundError):
                torch_lock.unlink()
        yield
    finally:
        os.close(fd)  # releases the lock


def _try_lock(fcntl, fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _owner_pid(owner: Path) -> int | None:
    """The pid the lock's holder wrote (None where unreadable: it may not have written yet)."""
    try:
        text = owner.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and len(text) < 12 else None


def _wait_for_lock(fcntl, fd: int, folder: Path, pid: int | None, max_wait: float, poll: float) -> None:
    who = f"process {pid}" if pid is not None else "another process"
    warnings.warn(f"hf_selfspec: {who} is building or loading the C++ row kernel in {folder}; waiting for it "
                  f"to finish (at most {max_wait:.0f} s, then this process goes on without the kernel)",
                  RuntimeWarning, stacklevel=4)
    deadline = time.monotonic() + max_wait
    while not _try_lock(fcntl, fd):
        if time.monotonic() >= deadline:
            raise BuildLockTimeout(
                f"{who} held the C++ row kernel's build lock in {folder} for more than {max_wait:.0f} s; the "
                "kernel is not loaded in this process (another row layout is used). If that process is stuck, "
                "end it: the next process loads (or builds) the kernel")
        time.sleep(poll)


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
    compiler = os.environ.get("CXX", "c++")  # what torch's extension builder runs
    if shutil.which(compiler) is None:
        _error = (f"no C++ compiler ({compiler!r}: not found; $CXX names another): install one "
                  "(g++ or clang++), and a new process builds the kernel once (~1 min)")
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
        flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
        folder = build_directory()
        sources = kernel_sources()
        with build_lock(folder):
            if _build_needed(folder, sources):  # a first call would otherwise pause a minute unexplained
                from hf_selfspec.logs import logger

                logger.warning(f"hf_selfspec: compiling the C++ row kernel for this machine and Python "
                               f"environment (once, ~1 min; kept in {folder})")
            module = load_inline(
                name=NAME, build_directory=str(folder), cpp_sources=sources,
                functions=["rows_linear", "rows_compact", "rows_linear_t", "rows_linear_heads", "rows_attention",
                           "rows_attention_alibi", "rows_attention_sinks", "rows_layer", "rows_layers",
                           "rows_draft_step", "rows_screen", "rows_pool", "rows_isa",
                           "rows_screen_vnni", "rows_mamba2_states", "rows_delta_states"],
                extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except BuildLockTimeout as e:
        _error = str(e)
        return None
    except Exception as e:  # noqa: BLE001 (no compiler / ninja: another layout is used)
        _error = _failure_reason(e)
        return None
    finally:
        os.environ["PATH"] = path
    if os.environ.get("HF_SELFSPEC_ROWS_POOL", "") == "1":
        module.rows_pool(1)
    return module


def _failure_reason(e: Exception) -> str:
    """The build's exception in one line: the compiler's first error where its output is in
    the message (a failed compile ends with ninja's "build stopped", which says nothing)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    detail = next((line for line in lines if "error:" in line.lower()), lines[-1] if lines else "")
    return f"{type(e).__name__}: {detail}"


def use_work_pool(on: bool | None = None) -> bool | None:
    """Which threads the kernels use: False (the default) torch's OpenMP team; True the
    kernel's own work-sharing pool, where a thread the OS has not scheduled leaves its share
    to the others instead of stalling every call (2.5-10x faster steps on a 2-core machine
    that other processes keep busy; within ~0-12% of OpenMP on idle cores: see cpu-rows/pool.h
    and docs/kernels.md). Results are bit for bit the same either way. HF_SELFSPEC_ROWS_POOL=1 turns
    it on at load. `on=None` only asks. Returns the previous setting (None: no kernel)."""
    module = _load_module()
    if module is None:
        return None
    return bool(module.rows_pool(-1 if on is None else int(bool(on))))


def use_avx512(on: bool | None = None) -> bool | None:
    """Whether products of 16-bit weights with 32 or more rows pair their rows in AVX-512
    registers (the default where the CPU has AVX-512 F/DQ/BW/VL; see cpu-rows/products.cpp, "AVX-512"),
    compact products with 7-8 rows per block run 2 x 8 tiles in 32 registers, and the
    LM-head screen sums in 16 lanes (with VNNI: quantised x, `screen_uses_vnni`).
    Results are bit for bit the same either way; False keeps the 8-lane tiles everywhere.
    `on=None` only asks. Returns whether paired tiles are in use after the call (always
    False on a CPU without AVX-512; None: no kernel)."""
    module = _load_module()
    if module is None:
        return None
    return bool(module.rows_isa(-1 if on is None else int(bool(on))))


def screen_uses_vnni() -> bool | None:
    """Whether the LM-head screen (`load_rows_screen`) quantises x to 16-bit integers for
    AVX-512 VNNI products (where the CPU has them and `use_avx512` is on); its answers are
    the same either way. None: no kernel."""
    module = _load_module()
    return None if module is None else bool(module.rows_screen_vnni())


def load_rows_linear():
    """The compiled `rows_linear(x [R, K], w [O, K]) -> y [R, O] float32` (x float32, w
    float32 / bfloat16 / float16; contiguous CPU tensors), or None when this machine cannot build or run it
    (`build_error()` says why)."""
    module = _load_module()
    return None if module is None else module.rows_linear


def load_rows_compact():
    """The compiled `rows_compact(w [O, K] float32) -> uint8 [O, K / 32 * (24, 20 or 36)]`: the
    matrix as the exact GGUF Q4_1, Q4_0 or Q8_0 blocks it holds (the first that reproduces
    every weight bit for bit: what a float32 matrix dequantized from such a file has); an
    empty tensor where none does. `rows_linear` and `rows_layer(s)` take the result in place
    of the matrix, with the same outputs bit for bit from a fifth to a quarter of the bytes.
    None when this machine cannot build or run the kernels."""
    module = _load_module()
    return None if module is None else module.rows_compact


def load_rows_linear_heads():
    """The compiled `rows_linear_heads(x [H, R, K], ws, transposed) -> y [H, R, O] float32`:
    y[h] = rows_linear(x[h], ws[h]) (rows_linear_t where `transposed`) bit for bit, the heads
    shared among the threads; or None when this machine cannot build or run it."""
    module = _load_module()
    return None if module is None else module.rows_linear_heads


def load_rows_linear_t():
    """The compiled `rows_linear_t(x [R, K], wt [K, O]) -> y [R, O] float32` for weights
    stored transposed (GPT-2's Conv1D; wt may be a column slice: unit column stride, row
    stride >= O), or None when this machine cannot build or run it (`build_error()` says
    why). Each output is one FMA chain over k in order: row-invariant by construction."""
    module = _load_module()
    return None if module is None else module.rows_linear_t


def load_rows_attention():
    """The compiled `rows_attention(q [R, Hq, d], k [Hkv, S, d], v [Hkv, S, d], limit int64
    [R], scale, path int64 [R, P], base int64 [R], softcap, window) -> o [R, Hq * d] float32` (q float32; k
    and v float32, bfloat16 or float16, the same; contiguous CPU tensors): row r sees
    logical keys [0, limit[r]]; key j is slot base[r] + j (`NO_BASE`: base 0), except that
    with P > 0 the row's last c_r keys are its c_r path slots (draft trees; -1 pads: see
    cpu-rows/attention.cpp). With a base per row, the rows of several sequences (each in its own KV
    region) share one call, each computing exactly what it computes alone. softcap > 0
    caps every score s at softcap * tanh(s / softcap) (Gemma 2); 0: none. window > 0: row r
    sees only its keys j > limit[r] - window (a sliding window); 0: all up to limit[r].
    None when this machine cannot build or run it (`build_error()` says why)."""
    module = _load_module()
    return None if module is None else module.rows_attention


def load_rows_attention_alibi():
    """The compiled `rows_attention_alibi(q, k, v, limit, scale, path, base, softcap, window,
    slopes)`: `load_rows_attention`'s with ALiBi (Bloom), slopes float32 [Hq]: each score s_j
    becomes s_j + slopes[h] * j (j the logical key index) before the softmax. None when this
    machine cannot build or run it."""
    module = _load_module()
    return None if module is None else module.rows_attention_alibi


def load_rows_attention_sinks():
    """The compiled `rows_attention_sinks(q, k, v, limit, scale, path, base, softcap, window,
    sinks)`: `load_rows_attention`'s with an attention sink per head (GPT-OSS, Granite-SWA),
    sinks float32 [Hq]: each head's softmax denominator gains exp(sinks[h]) (one more logit,
    of value 0). None when this machine cannot build or run it."""
    module = _load_module()
    return None if module is None else module.rows_attention_sinks


def load_rows_layer():
    """The compiled `rows_layer(h [R, H], weights, k_cache, v_cache, cos, sin, slots, limit,
    eps, scale, residual_scale, path, base) -> h after one Llama/Qwen3 decoder layer`
    (residual_scale: each block's output joins the residual stream times it, Granite's
    residual_multiplier, 1.0 elsewhere; cos, sin [R, rot]: RoPE on each head's first rot
    dimensions, rot = head_dim but for partial rotary; h, cos, sin float32; the
    projections one of float32 / bfloat16 / float16, the norms any of them; the cache float32,
    bfloat16 or float16, written rounded to nearest even; see cpu-rows/layers.cpp), or None when
    this machine cannot build or run it (`build_error()` says why)."""
    module = _load_module()
    return None if module is None else module.rows_layer


def load_rows_layers():
    """The compiled `rows_layers(h, weights, per_layer, k_cache [L, Hkv, S, d], v_cache,
    cos, sin, slots, limit, eps, scale, residual_scale, path, base, start, end)`: `rows_layer` for layers
    [start, end) in one call (weights: each layer's `per_layer` tensors in turn), or None
    when this machine cannot build or run it."""
    module = _load_module()
    return None if module is None else module.rows_layers


def load_rows_draft_step():
    """The compiled `rows_draft_step(h [n, H], e [n, H], h_norm, e_norm, down, up, out_norm,
    lm, eps, out_eps, k) -> [h', probs [n, k], ids [n, k]]`: one step of a top-layer draft
    head and its k likeliest tokens (see cpu-rows/draft.cpp), or None when this machine cannot
    build or run it (`build_error()` says why)."""
    module = _load_module()
    return None if module is None else module.rows_draft_step


def load_rows_screen():
    """The compiled `rows_screen(x [n, K] float32, q [V, K] int8, scale [V], bound [V], qnorm [V],
    w [V, K] float32, max_candidates) -> int64 [n]` (engine/screen.py's quantize_rows gives q ..
    qnorm): each row's exact argmax of x . w from the int8
    rows and their bounds (-1: not screenable; engine/screen.py, cpu-rows/screen.cpp), or None when
    this machine cannot build or run it."""
    module = _load_module()
    return None if module is None else module.rows_screen


def load_rows_states():
    """The compiled recurrent state updates (cpu_states.cpp) as (`rows_mamba2_states`,
    `rows_delta_states`): for a step's rows in order, each row's state from its parent's ring
    row of `states` [L, S, heads, ., .] (float32, updated in place at layer `layer`), its
    output returned; row-invariant by construction. None when this machine cannot build or
    run the kernel (`build_error()` says why)."""
    module = _load_module()
    return None if module is None else (module.rows_mamba2_states, module.rows_delta_states)


# `path` argument of rows_attention / rows_layer for steps without a tree
NO_PATH = torch.zeros(0, 0, dtype=torch.long)
# `base` argument for steps of one sequence whose keys start at slot 0
NO_BASE = torch.zeros(0, dtype=torch.long)


def build_error() -> str | None:
    """Why `load_rows_linear()` returned None (None when it built)."""
    return _error


def rows_linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64 (for tests: the kernel's error is fp32 rounding)."""
    return (x.double() @ w.double().t()).to(x.dtype)


def rows_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             limit: torch.Tensor, scale: float,
                             path: torch.Tensor | None = None,
                             base: torch.Tensor | None = None, softcap: float = 0.0,
                             window: int = 0, slopes: torch.Tensor | None = None,
                             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """What `rows_attention` (with `slopes`: `rows_attention_alibi`; with `sinks`:
    `rows_attention_sinks`) computes, in float64 (for tests)."""
    R, Hq, d = q.shape
    group = Hq // k.shape[0]
    kk = k.double().repeat_interleave(group, 0)  # [Hq, S, d]
    vv = v.double().repeat_interleave(group, 0)
    scores = torch.einsum("rhd,hsd->rhs", q.double() * scale, kk)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    slots = torch.arange(k.shape[1])
    visible = torch.zeros(R, k.shape[1], dtype=torch.bool)
    for r in range(R):
        tree = [] if path is None or path.shape[1] == 0 else [int(s) for s in path[r] if s >= 0]
        first = 0 if base is None or base.numel() == 0 else int(base[r])
        visible[r] = (slots >= first) & (slots <= first + int(limit[r]) - len(tree))
        visible[r, tree] = True
        # logical key j at slot first + j (prefix) or at its path slot
        logical = torch.full((k.shape[1],), -1)
        logical[first:first + int(limit[r]) + 1 - len(tree)] = torch.arange(int(limit[r]) + 1 - len(tree))
        for i, slot in enumerate(tree):
            logical[slot] = int(limit[r]) + 1 - len(tree) + i
        if window:
            visible[r] &= logical > int(limit[r]) - window
        if slopes is not None:  # ALiBi: + slope * logical key index
            scores[r] += slopes.double()[:, None] * logical.double()[None, :]
    hidden = ~visible  # [R, S]
    scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
    if sinks is not None:  # one more logit per head, its value 0 (dropped after the softmax)
        sink = sinks.double()[None, :, None].expand(R, Hq, 1)
        o = torch.einsum("rhs,hsd->rhd", torch.cat((scores, sink), -1).softmax(-1)[..., :-1], vv)
        return o.reshape(R, Hq * d).to(q.dtype)
    o = torch.einsum("rhs,hsd->rhd", scores.softmax(-1), vv)
    return o.reshape(R, Hq * d).to(q.dtype)
