"""Faults users cause without meaning to: generate(assistant="self") under
torch.inference_mode() (first call included: engine, heads and copies built there), a
model or heads made under inference_mode, an earlier failed call, and a model left in
train() mode with active dropout (refused before any work, with what to do)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_decoding import random_top_heads

from hf_selfspec import DecodeConfig, attach_heads

KW = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "enable_grad": torch.enable_grad}


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 40, (1, 20), generator=torch.Generator().manual_seed(seed))


def _expected(ids: torch.Tensor, seed: int = 2) -> torch.Tensor:
    """HF's own greedy generate() on a twin of the model (never attached)."""
    return tiny_model("qwen3", seed=seed, layers=4).generate(ids, attention_mask=torch.ones_like(ids), **KW)


def _with_top_heads(seed: int = 2):
    model = tiny_model("qwen3", seed=seed, layers=4)
    # thresholds 0: every step drafts, so the heads' float16 copies are made and read
    attach_heads(model, random_top_heads(model), decode=DecodeConfig(lookup="first", thresholds=0.0))
    return model


def test_first_call_inside_inference_mode_then_any_mode():
    """The engine, its KV cache and the heads' copies built by a first call inside
    inference_mode serve later calls in any grad mode, each HF's greedy tokens."""
    model = _with_top_heads()
    ids = _ids()
    expected = _expected(ids)
    for mode in ("inference_mode", "no_grad", "inference_mode", "enable_grad", "inference_mode"):
        with MODES[mode]():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW)
        assert torch.equal(out, expected), mode
    assert model.selfspec_stats.drafted > 0  # the heads drafted (their copies were read)


def test_model_and_heads_made_under_inference_mode():
    """Weights that are inference tensors (no version counter): a model loaded and attached
    inside inference_mode decodes HF's tokens inside and outside it."""
    ids = _ids(1)
    expected = _expected(ids)
    with torch.inference_mode():
        model = _with_top_heads()
        assert model.lm_head.weight.is_inference()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW)
    assert torch.equal(out, expected)
    assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW), expected)


def test_a_failed_call_inside_inference_mode_does_not_poison_the_model():
    class Raising:
        def put(self, value):
            raise RuntimeError("streamer failed")

        def end(self):
            pass

    model = _with_top_heads()
    ids = _ids(2)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="streamer failed"):
        model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", streamer=Raising(), **KW)
    expected = _expected(ids)
    for mode in ("no_grad", "inference_mode"):
        with MODES[mode]():
            assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW),
                               expected), mode


# ---- train() mode --------------------------------------------------------------------------

def _gpt2(dropout: float):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=512, n_embd=64, n_layer=2, n_head=4, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return GPT2LMHeadModel(config)


def test_train_mode_with_dropout_is_refused_before_any_work():
    model = attach_heads(_gpt2(0.1).train(), heads=False)
    ids = _ids()
    with pytest.raises(ValueError, match=r"training mode with active dropout \(dropout in .*model\.eval\(\)"):
        model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW)
    assert model._selfspec.engine is None  # refused before the engine was built
    # attention dropout has no module: the config's rate is read
    llama = tiny_model("llama")
    llama.config.attention_dropout = 0.1
    attach_heads(llama.train(), heads=False)
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 in its config.*model\.eval\(\)"):
        llama.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW)
    # what the message says to do
    llama.eval()
    assert llama.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW).shape[1] > ids.shape[1]


@pytest.mark.parametrize("build", [lambda: _gpt2(0.0), lambda: tiny_model("llama")], ids=["gpt2", "llama"])
def test_train_mode_without_active_dropout_decodes_hf_tokens(build):
    ids = _ids(3)
    reference = build().train()
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), **KW)
    model = attach_heads(build().train(), heads=False)
    assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW), expected)
