"""Hugging Face integration: `attach_heads(model)` and `model.generate(..., assistant="self")`.

`attach_heads` swaps the model's class for a subclass of its own HF class whose
`generate` understands `assistant="self"`; everything else is the HF model untouched.
With `assistant="self"` (a keyword, or an attribute of the GenerationConfig passed or of
`model.generation_config`) the call still goes through HF's own `generate()`
(GenerationConfig merge, max_new_tokens/max_length, stopping criteria, stop strings,
attention mask), which hands the prepared request to our decoding loop as a
`custom_generate` callable; the loop runs the engine and returns HF's output types. Every
option and input is checked before any work: what the engine cannot honour raises a clear
`ValueError` / `NotImplementedError` that says what to drop, never a silently different
result.

One job per module, each importing only those before it in this list:
    options      generate()'s options as the loop reads them (SelfSpecCall, HF drafting options)
    placement    where the model computes, and the positions the engine serves it there
    checks       every refusal of a call, before any work
    state        SelfSpecState: heads, configs, engines and the one-call-at-a-time lock
    decode_loop  the custom_generate loop: engine, rows, HF's output types
    generate     the attached class's generate(), HF's config merge, the attach-first hook
    attach       attach_heads / detach_heads / AutoSelfSpecModelForCausalLM
"""

from .attach import (
    AutoSelfSpecModelForCausalLM,
    _new_attached,  # noqa: F401 (pickles of an attached model name it here)
    attach_heads,
    detach_heads,
)
from .options import SelfSpecCall
from .state import SelfSpecState, selfspec_state

__all__ = ["AutoSelfSpecModelForCausalLM", "SelfSpecCall", "SelfSpecState", "attach_heads", "detach_heads",
           "selfspec_state"]
