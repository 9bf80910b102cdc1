"""hf_selfspec as a Hub `custom_generate` folder, for stock models:

    model.generate(**inputs, custom_generate="<this repo or folder>", trust_remote_code=True,
                   max_new_tokens=128)

transformers loads this file and calls `generate(model, **kwargs)`. It attaches the heads
(`selfspec_heads=`: a folder or Hub id; default: the heads shipped for the embedded default
model, or prompt lookup only when the model has none) once, then runs exact
self-speculative greedy decoding. Output: the same tokens as greedy `generate()`.
"""

from __future__ import annotations

import warnings


def generate(model, *args, selfspec_heads=None, **kwargs):
    import hf_selfspec

    if not hasattr(model, "_selfspec"):
        heads = selfspec_heads
        if heads is None:
            try:
                hf_selfspec.attach_heads(model)  # shipped heads, if they are for this model
                heads = "attached"
            except (ValueError, FileNotFoundError):
                warnings.warn("no heads for this model: hf_selfspec drafts with prompt lookup only",
                              stacklevel=2)
                heads = False
        if heads != "attached":
            hf_selfspec.attach_heads(model, heads)
    # the class's own generate (ours): HF set this module's generate on the instance
    return type(model).generate(model, *args, assistant="self", **kwargs)
