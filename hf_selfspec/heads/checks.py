"""Checks of single config.json / calibration.json fields: heads files are untrusted input.

Each check raises ValueError naming the field (a wrong type in a file is a bad value of
that file, reported like every other one); the repo loader prefixes the file. Nothing
here allocates more than the JSON already holds.
"""
# ruff: noqa: TRY004

from __future__ import annotations

import math

# Bounds that hold before a model is known (with one, its own dimensions bound the heads
# exactly: see base.check_compatible). They only stop a tiny file from asking for
# absurd sizes; every real model is far inside them.
MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 16
MAX_VOCAB = 1 << 22
MAX_DEPTH = 16  # chain steps of top-layer heads; each costs a small MLP per draft
MAX_ADAPTER_FACTOR = 8  # an adapter wider than 8 x hidden costs more than a decoder layer
MAX_PROBE = 4096  # base_probe values (the fingerprint samples a few hundred)
MAX_KNOTS = 100_000  # calibration knots per head
MAX_TEXT = 1000  # characters of base_model


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def need_int(name: str, value, lo: int, hi: int) -> int:
    if not is_int(value) or not lo <= value <= hi:
        raise ValueError(f"field {name!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def need_number(name: str, value, lo: float, hi: float, *, open_lo: bool = False) -> float:
    ok = is_number(value) and (lo < value if open_lo else lo <= value) and value <= hi
    if not ok:
        bracket = "(" if open_lo else "["
        raise ValueError(
            f"field {name!r} must be a finite number in {bracket}{lo}, {hi}], got {value!r}"
        )
    return float(value)


def need_str(name: str, value, max_len: int = MAX_TEXT, *, empty: bool = False) -> str:
    if not isinstance(value, str) or len(value) > max_len or (not empty and not value):
        raise ValueError(
            f"field {name!r} must be a {'' if empty else 'non-empty '}string of at most "
            f"{max_len} characters, got {type(value).__name__} {str(value)[:40]!r}"
        )
    return value


def need_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"field {name!r} must be true or false, got {value!r}")
    return value


def need_list(name: str, value, max_len: int, length: int | None = None) -> list:
    if not isinstance(value, list) or len(value) > max_len:
        raise ValueError(
            f"field {name!r} must be a list of at most {max_len} entries, got "
            f"{type(value).__name__}" + (f" of {len(value)}" if isinstance(value, list) else "")
        )
    if length is not None and len(value) != length:
        raise ValueError(f"field {name!r} has {len(value)} entries, expected {length}")
    return value


def need_dict(name: str, value) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"field {name!r} must be a JSON object, got {type(value).__name__}")
    return value


def need_object(data, what: str) -> dict:
    """The top level of a JSON file must be an object (a list is a common corruption)."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object, got a JSON {type(data).__name__}")
    return data


def need_fields(data: dict, required) -> None:
    missing = sorted(set(required) - data.keys())
    if missing:
        raise ValueError(f"heads config misses {', '.join(missing)}")


# the fields every heads config.json carries about its base model
IDENTITY_FIELDS = ("base_model", "base_fingerprint", "num_layers", "hidden_size", "vocab_size")


def need_model_identity(config, min_layers: int) -> None:
    """The fields every heads config.json carries about its base model: its name,
    fingerprint and the dimensions the heads were trained for."""
    need_str("base_model", config.base_model)
    need_str("base_fingerprint", config.base_fingerprint, 128)
    need_int("num_layers", config.num_layers, min_layers, MAX_LAYERS)
    need_int("hidden_size", config.hidden_size, 1, MAX_HIDDEN)
    need_int("vocab_size", config.vocab_size, 1, MAX_VOCAB)
