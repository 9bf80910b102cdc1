"""hf_selfspec as a Hub `custom_generate` folder, for stock models:

    model.generate(**inputs, custom_generate="<this repo or folder>", trust_remote_code=True,
                   max_new_tokens=128)

transformers loads this file and calls `generate(model, **kwargs)`. It attaches hf_selfspec
once (`selfspec_heads=`: a heads folder or Hub id; default: the heads shipped for the
embedded default model, or for any other model exact prompt lookup with a one-time warning
on how to get heads; False: prompt lookup, no warning), then runs exact self-speculative
decoding: greedy gives the same tokens as greedy `generate()`, sampling follows the model's
own sampling distribution.
"""

from __future__ import annotations


def generate(model, *args, selfspec_heads=None, **kwargs):
    import hf_selfspec

    if "_selfspec" not in model.__dict__:
        # HF set this module's generate on the instance; attach_heads refuses such a model
        # (its generate would not be ours), so it is taken off for the attach
        own = model.__dict__.pop("generate", None)
        try:
            hf_selfspec.attach_heads(model, selfspec_heads)
        finally:
            if own is not None:
                model.__dict__["generate"] = own
    # the class's own generate (ours): HF set this module's generate on the instance
    return type(model).generate(model, *args, assistant="self", **kwargs)
