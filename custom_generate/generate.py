"""hf_selfspec as a Hub `custom_generate` repo (transformers' "custom generation methods").

Two ways to use it, as the transformers docs describe:

    # 1. any Llama / Mistral / Qwen2 / Qwen3 / SmolLM3 / Phi-3 / Granite / OLMo 2-3 / Gemma 1-3 model, with this
    #    repo (or a local folder that holds custom_generate/generate.py) as the generation method
    out = model.generate(**inputs, custom_generate="<repo id or folder>", trust_remote_code=True)

    # 2. a model repo that carries this custom_generate/ folder: loading it with
    #    trust_remote_code=True makes its generate() this one (pass the inputs by keyword:
    #    transformers binds `model` by keyword, so a positional input_ids would collide)
    model = AutoModelForCausalLM.from_pretrained("<model repo or folder>", trust_remote_code=True)
    out = model.generate(**inputs)

transformers calls `generate(model, **kwargs)`. It attaches hf_selfspec once
(`selfspec_heads=`: a heads folder or Hub id; default: the heads shipped for the embedded
default model, or for any other model exact prompt lookup with a one-time warning on how to
get heads; False: prompt lookup, no warning), then runs exact self-speculative decoding
(`assistant="self"`): greedy gives the same tokens as greedy `generate()`, sampling follows
the model's own sampling distribution. Every other argument is `generate()`'s own.
"""

from __future__ import annotations

# model.__dict__ key: (selfspec_heads, the attach's state) of this function's last attach
_ATTACHED = "_selfspec_custom_generate_heads"


def generate(model, *args, selfspec_heads=None, **kwargs):
    import hf_selfspec

    # selfspec_heads is a per-call argument: a call naming other heads than the ones
    # attached re-attaches (it was silently ignored after the first call)
    state = model.__dict__.get("_selfspec")
    last = model.__dict__.get(_ATTACHED)
    if state is None:
        attach = True
    elif last is not None and last[1] is state:  # attached here: re-attach on a change
        attach = selfspec_heads != last[0]
    else:  # attached by the user (hf_selfspec.attach_heads): kept unless heads are named
        attach = selfspec_heads is not None
    if attach:
        # path 2 sets this module's generate on the instance; attach_heads refuses such a
        # model (its generate would not be ours), so it is taken off for the attach
        own = model.__dict__.pop("generate", None)
        try:
            hf_selfspec.attach_heads(model, selfspec_heads)
        finally:
            if own is not None:
                model.__dict__["generate"] = own
        model.__dict__[_ATTACHED] = (selfspec_heads, model.__dict__["_selfspec"])
    kwargs.setdefault("assistant", "self")
    # the class's own generate (hf_selfspec's), not the instance's (this function, path 2)
    return type(model).generate(model, *args, **kwargs)
