"""The model families the engine runs, as data: one module per family, each exporting
`FAMILY` (spec.Family: its name and its model types, each a spec.ModelType record of what
sets it apart from Llama), registered here by model_type. LayeredModel and the checks read a
model's record (`spec_of`) instead of testing its model_type against lists.

Adding a family: a module here with its FAMILY (and any functions its records name: a
config check, a reader of its fused projections, its multipliers), listed in FAMILY_MODULES,
and a test file tests/test_family_<name>.py with its configurations against HF's greedy
tokens. A model type is listed only after its modeling code was read against Llama's: a
model of another type is refused, never run on a guess.
"""

from __future__ import annotations

from . import delta_net, gemma, glm, gpt2, granite, latent, layernorm, llama, mamba, moe, persimmon, short_conv
from .spec import Family, Mixer, ModelType

__all__ = ["FAMILIES", "SPECS", "SUPPORTED_MODEL_TYPES", "Family", "Mixer", "ModelType", "spec_of", "types_where"]

# in the order their model types are listed (SUPPORTED_MODEL_TYPES)
FAMILY_MODULES = (llama, glm, gemma, granite, layernorm, persimmon, gpt2, moe, latent, short_conv, delta_net,
                  mamba)
FAMILIES: dict[str, Family] = {module.FAMILY.name: module.FAMILY for module in FAMILY_MODULES}
# model_type -> its record
SPECS: dict[str, ModelType] = {}
for _family in FAMILIES.values():
    for _spec in _family.types:
        if _spec.name in SPECS:
            raise RuntimeError(f"model type {_spec.name!r} registered by {SPECS[_spec.name].family} and {_family.name}")
        SPECS[_spec.name] = _spec

SUPPORTED_MODEL_TYPES = tuple(SPECS)


def spec_of(model_type: str | None) -> ModelType:
    """The registry's record of `model_type`; for a type the engine does not run (refused by
    layered.check_model_type), Llama's defaults, so every fact reads False."""
    spec = SPECS.get(model_type)
    return spec if spec is not None else ModelType(str(model_type))


def types_where(fact) -> tuple[str, ...]:
    """The model types whose record has `fact` (a predicate on ModelType), in registry order."""
    return tuple(name for name, spec in SPECS.items() if fact(spec))


# the model types of some facts, for code outside the engine that asks by list
NORM_PLUS_ONE_TYPES = types_where(lambda s: s.norm_plus_one)
TOKEN_TYPE_EMBEDDING_TYPES = types_where(lambda s: s.token_type_embeddings)
STATEFUL_MIXER_TYPES = types_where(lambda s: s.stateful)
