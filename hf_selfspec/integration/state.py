"""What `attach_heads` keeps on a model (SelfSpecState): its heads and configs, the engines
(the model's and a draft model's, each with its KV cache) built on first use and rebuilt when
the weights move, and the lock that lets one generate(assistant='self') call at a time use
them."""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..decoding.cycle import DecodeConfig
from ..engine.core import Engine, EngineConfig
from ..engine.layered import served_positions, text_config
from .options import SelfSpecCall
from .placement import _check_positions, _streams_weights, _windowed, model_device


@dataclass
class SelfSpecState:
    """What `attach_heads` keeps on a model."""

    heads: Any  # ExitHeads or None (prompt lookup only)
    decode_config: DecodeConfig
    engine_config: EngineConfig
    engine: Engine | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    draft_model: Any = None  # the last assistant_model and its engine (own KV cache)
    draft_engine: Engine | None = None
    owner: int | None = None  # thread ident of the call that holds `lock`
    pending: SelfSpecCall | None = None  # the holder's call, until HF has merged its config

    @contextlib.contextmanager
    def serving(self, call: SelfSpecCall | None = None):
        """One call at a time per model (one engine, one KV cache). Another thread waits
        its turn; the thread that already holds the model (a streamer or stopping
        criterion calling generate(assistant="self") on the same model from inside) gets
        a RuntimeError, where waiting on itself would deadlock. `call` waits in `pending`
        for HF's merged GenerationConfig (take_pending)."""
        me = threading.get_ident()
        if self.owner == me:  # only the holder ever writes its own ident here
            raise RuntimeError(
                "generate(assistant='self') was called again on the same model from inside a "
                "running generate(assistant='self') call (a streamer, stopping criterion or "
                "logits processor?). The model decodes one request at a time: run the second "
                "call after the first returns, or on another model (copy.deepcopy(model))"
            )
        with self.lock:
            self.owner, self.pending = me, call
            try:
                yield
            finally:
                self.owner = self.pending = None

    # A copy or pickle of the model carries the heads and configs; the lock is new and the
    # engines (KV caches that view the original's weights) are rebuilt lazily on first use.
    _NOT_COPIED = ("lock", "owner", "pending", "engine", "draft_model", "draft_engine")

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in self._NOT_COPIED}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.lock = threading.Lock()
        self.owner = self.pending = self.engine = self.draft_model = self.draft_engine = None

    def take_pending(self) -> SelfSpecCall | None:
        """The call of the thread that holds the model, once (HF merges one GenerationConfig
        per generate()); None for any other thread, e.g. a plain generate() beside it."""
        if self.owner != threading.get_ident():
            return None
        call, self.pending = self.pending, None
        return call

    def draft_engine_for(self, draft_model, capacity: int) -> Engine:
        """The draft model's engine, with as many KV slots as the main engine, or as its
        max_position_embeddings allow where those are fewer: a draft model of shorter context
        serves every request that fits it (the request is checked against it up front)."""
        limit = served_positions(text_config(draft_model), _windowed(draft_model)) or capacity
        capacity = min(capacity, limit)
        if self.draft_model is not draft_model or not self._current(self.draft_engine, draft_model):
            self.draft_engine = None  # free the old cache first
            self.draft_engine = self._new_engine(draft_model, capacity)
            self.draft_model = draft_model
        else:  # a new request: no slot is in use yet, nothing to copy
            self.draft_engine.ensure_capacity(capacity, keep=0, release=True)
        return self.draft_engine

    def engine_for(self, model, need: int) -> Engine:
        """The model's engine with room for `need` KV slots: built at the first call and
        rebuilt when the model's weights moved (dtype, device, new tensors); otherwise its
        KV cache grows (or shrinks back) to the request, measuring nothing again."""
        _check_positions(model, need, "the model's")
        if not self._current(self.engine, model):
            self.engine = None  # free the old cache first
            if self.heads is not None:  # the heads' copies of the model's weights follow them
                self.heads.bind(model)  # (a dtype / device change, new tensors)
            self.engine = self._new_engine(model, need)
        else:  # a new request: no slot is in use yet, nothing to copy
            self.engine.ensure_capacity(need, keep=0, release=True)
            self.engine.next_request()
        return self.engine

    def step_width(self, model) -> int:
        """Rows per engine step for `model`: EngineConfig.width, or its streamed_width where
        accelerate streams weights in (a step then costs its weights' transfer, nearly
        whatever its rows: wide draft trees pay)."""
        return self.engine_config.streamed_width if _streams_weights(model) else self.engine_config.width

    @staticmethod
    def _current(engine: Engine | None, model) -> bool:
        """Whether `engine` still serves `model` as it is now (not stale)."""
        return engine is not None and engine.view.model is model and not engine.is_stale()

    def _new_engine(self, model, need: int) -> Engine:
        """An engine with `need` KV slots or more: the configured capacity, rounded up to
        256 slots, at most the model's max_position_embeddings. Its executor: the
        configured one, where "auto" means CUDA graphs on a CUDA model (eager with one
        warning where they cannot be set up or captured) and eager elsewhere."""
        from ..engine.cuda_graphs import resolve_executor

        limit = served_positions(text_config(model), _windowed(model)) or need
        capacity = min(-(-max(self.engine_config.capacity, need) // 256) * 256, limit)
        requested = self.engine_config.executor
        # a graph cannot replay accelerate's hooks, which bring offloaded weights in
        streams, width = _streams_weights(model), self.step_width(model)
        device = torch.device("cpu") if streams else model_device(model)
        executor = resolve_executor(requested, device)
        config = replace(self.engine_config, capacity=max(capacity, 2 * width), executor=executor, width=width)
        if requested != "auto" or executor != "cuda_graphs":
            return Engine(model, config)
        try:  # graphs chosen for the caller, not asked for: eager where they cannot be set up
            return Engine(model, config)
        except Exception as err:  # noqa: BLE001 -- any failure of the graph set-up: run eagerly
            warnings.warn(
                f"the CUDA-graph executor could not be set up ({type(err).__name__}: {err}); this "
                "engine runs its step programs eagerly (same results, more host time per step). A "
                "capture that fails later falls back the same way (CudaGraphRunner).",
                RuntimeWarning, stacklevel=2)
            return Engine(model, replace(config, executor="eager"))


def selfspec_state(model) -> SelfSpecState:
    """What `attach_heads` keeps on `model` (its heads, configs and engines), for tools and
    benchmarks that set a decode config or read the engine; ValueError for a model that
    was not attached."""
    state = getattr(model, "__dict__", {}).get("_selfspec")
    if state is None:
        raise ValueError(f"{type(model).__name__} has no hf_selfspec state: call hf_selfspec.attach_heads(model) first")
    return state
