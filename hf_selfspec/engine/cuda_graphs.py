"""CUDA graphs of the engine's step programs `seg`, `verify` and `ar`, captured once per key.

Why graphs: an eager decode step of a 1B model launches ~30 kernels per layer from Python,
which costs more host time than the GPU needs to read the weights. A CUDA graph launches
the whole step at once. What lets ONE captured graph serve every call with its key:

  rows       The fixed layout computes every program on exactly W rows (real rows first).
             A graph's inputs are static [W, ...] buffers: a call copies its n real rows in
             and zeroes the rest, so `seg[a, b]` and `verify[c]` serve any n in 1..W.
  metadata   Positions, KV slots and key limits are read inside the graph from the
             engine's device buffer `engine.meta_buffer`, which `engine.make_meta` fills with one
             copy before every step; RoPE cos/sin are gathered from it inside the graph.
  trees      A draft tree's path slots (meta.path) go into a static device buffer
             [W, W] (-1 pads; a path in a step of at most W rows has at most W slots),
             copied in before each replay, so one program per key serves chains and trees.
             The kernel visits a row's keys by logical index, so the wider buffer (more
             -1 columns than the eager step's) adds only masked keys: the same bits.
  keys       The number of keys attention visits must not be baked in at capture. On CUDA
             the engine's attention is the Triton kernel `row_attention` (`TritonAttention`
             in attention.py): each (row, head) program reads its prefix length from the metadata
             buffer and loops over exactly the keys it needs, so a graph replays at any
             position and costs what the context costs. The alternative, `block_attention`
             captured at the full capacity (mask built in the graph over every key block),
             is what this runner falls back to where the engine does not use the kernel; it
             gives the same bits (a block a row cannot see adds exactly nothing) but visits
             capacity/KEY_BLOCK blocks per layer whatever the context, ~6 ops each.

All graphs share one memory pool. Their outputs live in that pool (a graph's freed
intermediates may back another graph's outputs), so every output is cloned right after its
replay, before any other replay: callers own what they get, exactly as from the eager
programs. Same maths as the eager path by construction: the graph body calls the engine's
own `seg` / `verify` / `embed_rows`; only the metadata is taken from the device buffer.
An engine built with `EngineConfig(executor="cuda_graphs")` owns one runner, attached for
its lifetime; when its KV cache is reallocated (`Engine.ensure_capacity`) the runner forgets
its graphs and captures again.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf_selfspec.kernels.cpu_rows import NO_PATH

from .attention import triton_attention, uses_row_attention, visible_bias  # noqa: F401 (re-exported)
from .meta import StepMeta

if TYPE_CHECKING:  # annotations only: the engine (core.py) builds this executor
    from .interface import GraphHost

# ("seg", start, end) | ("verify", start) | ("ar",)
ProgramKey = tuple


def graphs_by_default(device: torch.device) -> bool:
    """Whether an engine on `device` runs the CUDA-graph executor unless told otherwise:
    on CUDA, where graphs are worth several times the eager step (docs/gpu.md)."""
    return device.type == "cuda"


def resolve_executor(requested: str, device: torch.device) -> str:
    """The executor an engine on `device` gets for `EngineConfig.executor == requested`:
    "auto" is "cuda_graphs" where `graphs_by_default`, else "eager"; an explicit "eager"
    or "cuda_graphs" is kept as it is."""
    if requested == "auto":
        return "cuda_graphs" if graphs_by_default(device) else "eager"
    return requested


def _require_cuda(engine: GraphHost) -> None:
    device = engine.view.device
    if device.type != "cuda":
        raise ValueError(
            f"CUDA graphs need a CUDA device; this engine's model is on {device}. On the CPU "
            "call the engine's programs directly (engine.seg / engine.verify / engine.ar_step)."
        )
    if engine.layout.name != "fixed":
        raise ValueError(
            f"CUDA graphs need the fixed row layout (every program on W rows); this engine "
            f"uses {engine.layout.name!r}: build it with EngineConfig(row_layout='fixed')."
        )


@dataclass
class _Program:
    graph: torch.cuda.CUDAGraph
    outputs: tuple[torch.Tensor, ...]  # [W, ...] each, in the shared pool


class CudaGraphRunner:
    """The engine's `seg`, `verify` and `ar_step`, each captured once per key as a CUDA graph.

    Drop-in: the methods take and return what the engine's do (the caller still writes the
    step's metadata with `engine.make_meta`). `attached()` routes the engine's own methods
    here, so `SelfSpecDecoder` and `Engine.generate_ar` use the graphs unchanged. If a
    capture fails, one `RuntimeWarning` says why and every later call runs eagerly.
    """

    def __init__(self, engine: GraphHost):
        _require_cuda(engine)
        self.engine = engine
        self.width = engine.width
        v = engine.view
        # the engine's own programs, bound to the class functions so that `attached()`
        # (which shadows them on the instance) never routes a graph body back here
        cls = type(engine)
        self._engine_seg = cls.seg.__get__(engine)
        self._engine_verify = cls.verify.__get__(engine)
        self._engine_ar_step = cls.ar_step.__get__(engine)
        # static inputs, outside the graph pool; shared by all programs (copied in per call)
        self._hidden_in = torch.zeros(self.width, v.hidden_size, dtype=v.dtype, device=v.device)
        self._tokens_in = torch.zeros(self.width, dtype=torch.long, device=v.device)
        # tree path slots of the step's rows (module docstring, "trees"); all -1 for chains
        self._path_host = torch.full((self.width, self.width), -1, dtype=torch.int32)
        self._path_in = torch.full((self.width, self.width), -1, dtype=torch.int32, device=v.device)
        self._path_loaded = False  # whether _path_in holds a tree's paths (else all -1)
        self._programs: dict[ProgramKey, _Program] = {}
        self._pool = None  # torch.cuda.graph_pool_handle(), made at the first capture
        self.eager = False  # True once a capture failed: everything runs eagerly
        self.fallback_reason: str | None = None

    # ---- keys ---------------------------------------------------------------------------

    def decoding_keys(self, exit_layers: Iterable[int] = ()) -> list[ProgramKey]:
        """Every program the decoding loop can ask for with exit heads at `exit_layers`:
        catch-up segs between any two depths in {0} + exit layers, verify from each depth,
        and ar. Lookup-only decoding needs ("verify", 0) and ("ar",)."""
        depths = sorted({0, *exit_layers})
        keys: list[ProgramKey] = [("seg", a, b) for i, a in enumerate(depths) for b in depths[i + 1:]]
        return keys + [("verify", d) for d in depths] + [("ar",)]

    def _check_key(self, key: ProgramKey) -> ProgramKey:
        key = tuple(key)
        layers = self.engine.view.num_layers
        ok = (
            (len(key) == 3 and key[0] == "seg" and 0 <= key[1] < key[2] <= layers)
            or (len(key) == 2 and key[0] == "verify" and 0 <= key[1] <= layers)
            or key == ("ar",)
        )
        if not ok:
            raise ValueError(
                f"unknown program key {key!r}: use ('seg', start, end) with 0 <= start < end "
                f"<= {layers}, ('verify', start) with 0 <= start <= {layers}, or ('ar',)"
            )
        return key

    @property
    def captured(self) -> list[ProgramKey]:
        return list(self._programs)

    def program(self, key: ProgramKey) -> _Program | None:
        """The captured program of `key` (None when not captured). For benchmarks that time
        `program.graph.replay()` alone; its outputs are overwritten by later replays."""
        return self._programs.get(tuple(key))

    # ---- programs (same signatures as the engine's) ---------------------------------------

    def seg(self, h: torch.Tensor, start: int, end: int, meta: StepMeta) -> torch.Tensor:
        """seg[start, end]: h [n, H] -> [n, H]; the step's metadata was written by `meta`."""
        if self.eager:
            return self._engine_seg(h, start, end, meta)
        key = self._check_key(("seg", start, end))

        def eager():
            return (self._engine_seg(h, start, end, meta),)

        if not self._load_path(meta):
            return eager()[0]
        n = self._load_hidden(h)
        return self._replay(key, eager, n)[0]

    def verify(self, h: torch.Tensor, start: int, meta: StepMeta, logits: bool = True):
        """verify[start]: h [n, H] -> (logits [n, V], argmax [n], final hidden [n, H]); the
        graphs always compute the logits (`logits` is accepted for Engine.verify's callers)."""
        if self.eager:
            return self._engine_verify(h, start, meta)
        key = self._check_key(("verify", start))

        def eager():
            return self._engine_verify(h, start, meta)

        if not self._load_path(meta):
            return eager()
        n = self._load_hidden(h)
        return self._replay(key, eager, n)

    def ar_step(self, token: int, position: int, logits: bool = True):
        """ar: -> (logits [V], next token id, final hidden [H]), as `Engine.ar_step` (the
        graphs always compute the logits)."""
        if self.eager:
            return self._engine_ar_step(token, position)
        self._load_path(self.engine.make_meta([position]))
        # fill_ passes the id as a kernel argument: no host->device copy, no sync
        self._tokens_in[:1].fill_(int(token))
        logits, argmax, final = self._replay(
            ("ar",), lambda: self._engine_ar_step(token, position), 1)
        return logits[0], int(argmax[0]), final[0]

    _ROUTED = ("seg", "verify", "ar_step")

    def attach(self) -> None:
        """From now on `engine.seg`, `engine.verify` and `engine.ar_step` are this runner's
        (instance attributes shadowing the class methods): an engine built with
        `EngineConfig(executor="cuda_graphs")` is attached for its lifetime."""
        engine = self.engine
        if any(name in vars(engine) for name in self._ROUTED):
            raise RuntimeError("a CudaGraphRunner is already attached to this engine")
        for name in self._ROUTED:
            setattr(engine, name, getattr(self, name))

    def detach(self) -> None:
        for name in self._ROUTED:
            vars(self.engine).pop(name, None)

    @contextmanager
    def attached(self) -> Iterator[CudaGraphRunner]:
        """Within the block the engine's programs are this runner's (removed on exit)."""
        self.attach()
        try:
            yield self
        finally:
            self.detach()

    def reset(self) -> None:
        """Forget every captured program: the engine's KV cache was reallocated (it grew or
        shrank), and a graph replays the addresses it was captured with."""
        self._programs.clear()

    # ---- capture ------------------------------------------------------------------------

    def warmup(self, keys: Iterable[ProgramKey]) -> None:
        """Capture `keys` now (e.g. `decoding_keys(...)`), so no capture lands inside a timed
        loop. The capture's warm-up run really executes, so the metadata is first set to a
        harmless step: one row at position 0 whose KV goes to the trash slot."""
        keys = [self._check_key(k) for k in keys]
        engine = self.engine
        self._load_path(engine.make_meta([0]))
        engine.meta_buffer[1].fill_(engine.trash_slot)
        self._hidden_in.zero_()
        self._tokens_in.zero_()
        for key in keys:
            if self.eager:
                return
            if key not in self._programs:
                self._capture(key)

    def _load_path(self, meta: StepMeta) -> bool:
        """Put the step's tree paths in the static buffer (one copy; nothing for a chain
        after a chain). False when the step is not one the graphs can replay: paths wider
        than the buffer, or rows in KV regions (batched steps run eagerly)."""
        path = meta.path
        if meta.base.numel() or path.shape[0] > self.width or path.shape[1] > self.width:
            return False
        if not path.numel():
            if self._path_loaded:
                self._path_in.fill_(-1)
                self._path_loaded = False
            return True
        host = self._path_host
        host.fill_(-1)
        host[: path.shape[0], : path.shape[1]] = path
        self._path_in.copy_(host)
        self._path_loaded = True
        return True

    def _load_hidden(self, h: torch.Tensor) -> int:
        n = h.shape[0]
        if not 1 <= n <= self.width:
            raise ValueError(f"a step takes 1..{self.width} rows, got {n}")
        self._hidden_in[:n].copy_(h)
        self._hidden_in[n:].zero_()  # as the eager path pads
        return n

    def _replay(self, key: ProgramKey, eager: Callable[[], tuple], n: int) -> tuple:
        """Replay (capturing first if needed) and return clones of the first n output rows;
        `eager` computes the same step without graphs (used once a capture has failed)."""
        program = self._programs.get(key) or self._capture(key)
        if program is None:
            return eager()
        program.graph.replay()
        return tuple(t[:n].clone() for t in program.outputs)

    def _graph_meta(self) -> StepMeta:
        """A StepMeta whose tensors are all computed from the device buffer, in the graph."""
        engine, v, width = self.engine, self.engine.view, self.width
        meta = engine.meta_buffer[:, :width]  # fixed layout: W GEMM rows = W attention rows
        positions, slots, key_limit = meta[0], meta[1], meta[2]
        if not engine.attention.needs_masks:
            biases = []  # the kernel reads key_limit itself
        else:  # block_attention at full capacity: same bits, more work (module docstring)
            biases = [visible_bias(key_limit, engine.num_slots, engine.group)]
        # tree paths from the static buffer, for an attention that follows them (Triton);
        # the block attention takes no trees (make_meta refuses them for it)
        path = self._path_in if engine.attention.supports_trees else NO_PATH
        return StepMeta(positions=positions, slots=slots, key_limit=key_limit, num_real=width,
                        rows=width, biases=biases, cos=v.cos[positions], sin=v.sin[positions],
                        path=path)

    def _body(self, key: ProgramKey) -> Callable[[], tuple]:
        """The program of `key` on the static inputs: the engine's own functions."""
        engine = self.engine
        if key[0] == "seg":
            return lambda: (self._engine_seg(self._hidden_in, key[1], key[2], self._graph_meta()),)
        if key[0] == "verify":
            return lambda: self._engine_verify(self._hidden_in, key[1], self._graph_meta())
        # ar: the token's embedding row, then verify from layer 0 (as Engine.ar_step)
        return lambda: self._engine_verify(engine.view.embed_rows(self._tokens_in), 0,
                                           self._graph_meta())

    @torch.no_grad()
    def _capture(self, key: ProgramKey) -> _Program | None:
        try:
            graph, outputs = self._record(self._body(key))
        except Exception as err:  # noqa: BLE001 -- any failure: keep decoding, eagerly
            self._fall_back(key, err)
            return None
        program = _Program(graph, tuple(outputs))
        self._programs[key] = program
        return program

    def _record(self, body: Callable[[], tuple]):
        """PyTorch's capture recipe: warm up on a side stream (lazy cuBLAS/Triton set-up and
        JIT compilation must not happen during capture), then capture into the shared pool.
        The warm-up writes the KV the replay then rewrites from the same inputs."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = body()
        return graph, outputs

    def _fall_back(self, key: ProgramKey, err: Exception) -> None:
        self.eager = True
        self.fallback_reason = f"{type(err).__name__}: {err}"
        self._programs.clear()
        warnings.warn(
            f"CUDA graph capture of {key} failed ({self.fallback_reason}); the step programs "
            "run eagerly from now on (same results, more host time per step).",
            RuntimeWarning,
            stacklevel=2,
        )
