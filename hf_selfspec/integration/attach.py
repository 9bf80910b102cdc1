"""`attach_heads` / `detach_heads` / `AutoSelfSpecModelForCausalLM`: the model's class swapped
for a subclass of its own HF class whose generate() understands assistant='self' (one per
base class, pickled as its base), its arguments checked, and the heads chosen: the given ones,
the shipped ones for the embedded default model, or none (exact prompt lookup, one warning)."""

from __future__ import annotations

import json
import warnings

from ..decoding.cycle import DecodeConfig
from ..engine.core import DEFAULT_CAPACITY, EngineConfig
from ..engine.dispatch import is_dispatched
from ..engine.errors import UnsupportedModelError
from ..engine.layered import dispatch_placement, served_positions, text_config
from .generate import _generate, _install_attach_first_check, _prepare_generation_config
from .placement import _windowed
from .state import SelfSpecState

_SUBCLASSES: dict[type, type] = {}


def _selfspec_class(base: type) -> type:
    """A subclass of the model's HF class with our generate (one per base class)."""
    if getattr(base, "_is_selfspec_class", False):
        return base
    if base not in _SUBCLASSES:
        # same __name__ so save_pretrained writes the base architecture name
        _SUBCLASSES[base] = type(base.__name__, (base,), {
            "generate": _generate, "_prepare_generation_config": _prepare_generation_config,
            "_is_selfspec_class": True, "__module__": base.__module__,
            "__qualname__": base.__qualname__, "__reduce_ex__": _reduce_attached,
        })
    return _SUBCLASSES[base]


def _reduce_attached(self, protocol):
    """pickle finds a class by module and name, which for our subclass lead to the base
    class: rebuild the subclass from its base instead (copy.deepcopy takes this path too)."""
    return _new_attached, (type(self).__mro__[1],), self.__dict__


def _new_attached(base: type):
    cls = _selfspec_class(base)
    return cls.__new__(cls)


def attach_heads(model, heads=None, *, decode: DecodeConfig | None = None,
                 engine: EngineConfig | None = None, revision: str | None = None):
    """Give an HF causal LM `generate(..., assistant="self")`, in place; returns `model`.

    heads: where the drafts come from, besides prompt lookup:
        None (default): the heads shipped with hf_selfspec (top-layer draft heads) when
            `model` is the embedded default SmolLM2-135M-Instruct; for any other model no
            heads: exact prompt lookup in our engine, with a one-time warning saying how to
            get heads (`hf-selfspec train-heads`, or heads="org/repo").
        a folder or a Hub repo id: heads saved for this model (any kind: config.json says
            which); heads for another model are refused with an error naming both.
        loaded heads (`ExitHeads` / `TopDraftHeads`).
        False: no heads, exact prompt lookup only, and no warning.
    decode: knobs of the speculative loop (DecodeConfig); engine: width / KV capacity.
    revision: the Hub revision of `heads`.

    Greedy output is the model's own greedy output token for token, sampled output follows
    the model's own sampling distribution; the drafters only change the speed.

    Weights mapped from the checkpoint file (how transformers loads safetensors on the CPU)
    are copied once into the process's own memory, which the engine streams faster: the
    same Parameter objects and values, new storage (engine/residence.py).
    """
    from ..engine.layered import LayeredModel
    from ..engine.residence import move_file_mapped_weights

    _install_attach_first_check()
    _check_attach_arguments(heads, decode, engine)
    # the architecture first: a window is worth mentioning only on a model the engine runs
    LayeredModel.check_supported(model)  # unsupported features or layers fail here, early
    if "generate" in model.__dict__:
        raise ValueError(
            "this model instance has its own generate attribute (loaded with a custom_generate "
            "repo?); load it without custom_generate to attach heads"
        )
    # before the heads bind to the model's embedding: they keep a reference to it
    move_file_mapped_weights(model)
    if heads is not None and heads is not False:
        _check_heads_devices(model)
    loaded = _default_or_no_heads(model, revision) if heads is None else _load_heads(model, heads, revision)
    if loaded is not None and heads is None:
        _check_heads_devices(model)
    if decode is None:
        decode = DecodeConfig(lookup="first" if loaded is not None else "only")
    if engine is None:
        limit = served_positions(text_config(model), _windowed(model)) or DEFAULT_CAPACITY
        engine = EngineConfig(capacity=min(DEFAULT_CAPACITY, limit))
    # validate the pair once, here, with the real heads
    if loaded is not None and decode.lookup != "only" and decode.thresholds is None \
            and getattr(loaded, "calibration", None) is None:
        raise ValueError("the heads carry no calibration.json: pass decode=DecodeConfig(thresholds=...)")
    model.__class__ = _selfspec_class(type(model))
    model._selfspec = SelfSpecState(loaded, decode, engine)
    model.selfspec_stats = None
    return model


def _check_heads_devices(model) -> None:
    """Draft heads read rows of the token embedding and of the LM head in the same product:
    on a model accelerate spreads over several devices both must execute on one."""
    if not is_dispatched(model):
        return
    placement = dispatch_placement(model)
    embedding, head = placement.embedding.device, placement.lm_head.device
    if embedding != head:
        raise UnsupportedModelError(
            f"draft heads read the token embedding and the LM head together, and this device_map runs the "
            f"embedding on {embedding} and the LM head on {head}. Put both on one device in the device_map "
            "(the LM head's entry on the embedding's device), or attach_heads(model, heads=False) to decode "
            "with prompt lookup only")


def _check_attach_arguments(heads, decode, engine) -> None:
    """attach_heads' arguments of the types it takes: another type (heads=True, a dict of
    settings) would fail deep in a path join, or only at the first generate() call."""
    import os

    from ..heads import is_heads

    if not (heads is None or heads is False or isinstance(heads, (str, os.PathLike)) or is_heads(heads)):
        raise TypeError(
            f"heads must be a heads folder, a Hub repo id ('org/name'), loaded heads, None (the shipped "
            f"heads for the default model, else prompt lookup) or False (no heads), got {heads!r}")
    for name, value, cls in (("decode", decode, DecodeConfig), ("engine", engine, EngineConfig)):
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"{name} must be {'an' if cls is EngineConfig else 'a'} {cls.__name__} or None, "
                            f"got {type(value).__name__} {value!r}: "
                            f"pass hf_selfspec.{cls.__name__}(...)")


_WARNED_NO_HEADS: set[str] = set()


def _default_or_no_heads(model, revision):
    """heads=None: the shipped heads when `model` is the model they were trained for (the
    embedded default), else no heads (exact prompt lookup) and a one-time warning.

    Decided here, before the heads loader runs: the default heads' config.json names the
    dimensions and weight fingerprint of their base model. Another model's dimensions never
    try the heads; equal dimensions with other weights (a fine-tune, another rounding) ask the
    loader, which accepts a near-identical checkpoint or refuses with a ValueError."""
    from ..heads import default_heads_path, fingerprint

    folder = default_heads_path()
    base = _read_base(folder / "config.json")
    name = getattr(model.config, "_name_or_path", "") or ""
    if base is not None:
        text = text_config(model)
        dims = (text.num_hidden_layers, text.hidden_size, text.vocab_size)
        if dims == (base.get("num_layers"), base.get("hidden_size"), base.get("vocab_size")):
            if fingerprint(model) == base.get("base_fingerprint"):
                return _load_heads(model, None, revision)  # the default model: errors are real
            try:
                return _load_heads(model, None, revision)
            except ValueError:
                pass  # weights too far from the heads' base: no heads, as for any other model
    key = fingerprint(model)
    if key not in _WARNED_NO_HEADS:
        _WARNED_NO_HEADS.add(key)
        base_name = (base or {}).get("base_model", "the embedded default model")
        warnings.warn(
            f"no heads given and the heads shipped with hf_selfspec are for {base_name}, not for "
            f"{repr(name) if name else 'this ' + type(model).__name__}: assistant='self' drafts with exact "
            "prompt lookup only (the model's own "
            "greedy output; faster where the text repeats its context). For more speed get heads "
            f"for this model: train them with `hf-selfspec train-heads {name or 'MODEL'} --out FOLDER --minutes 60` "
            "and attach_heads(model, heads='FOLDER'), or pass published heads (heads='org/repo'). "
            "heads=False attaches without heads and without this warning.",
            UserWarning, stacklevel=3,
        )
    return None


def _read_base(path) -> dict | None:
    """The shipped heads' config.json as a dict, or None where none is shipped / readable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _load_heads(model, heads, revision):
    """Heads of any kind (config.json says which) from a folder, a Hub id or an object."""
    from ..heads import check_compatible, default_heads_path, is_heads, load_heads

    if heads is False:
        return None
    if is_heads(heads):  # loaded heads of any kind (heads/kinds.py)
        heads.config.validate()
        check_compatible(heads.config, model)  # refuses another shape, warns if near-identical
        return heads.bind(model)
    if heads is None:
        heads = default_heads_path()
        if not (heads / "config.json").is_file():
            raise FileNotFoundError(f"no default heads are shipped in {heads}; pass heads=... or heads=False")
    return load_heads(heads, model, revision=revision)  # a folder, or a Hub repo id fetched/cached


def detach_heads(model):
    """Undo `attach_heads`: the model's own class and generate again."""
    cls = type(model)
    if getattr(cls, "_is_selfspec_class", False):
        model.__class__ = cls.__mro__[1]
    model.__dict__.pop("_selfspec", None)
    model.__dict__.pop("selfspec_stats", None)
    return model


class AutoSelfSpecModelForCausalLM:
    """`AutoModelForCausalLM.from_pretrained(...)` + `attach_heads(...)` in one call."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, heads=None, *, decode=None,
                        engine=None, **hf_kwargs):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, **hf_kwargs)
        model.eval()
        return attach_heads(model, heads, decode=decode, engine=engine)
