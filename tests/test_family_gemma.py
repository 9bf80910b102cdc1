"""The gemma family (hf_selfspec/engine/families/gemma.py: Gemma's norms by 1 + w, GELU-gated MLPs, soft caps): its
configurations give HF's greedy tokens (fp32; a left-padded batch row for row) and its
logits, and what the engine cannot run of it is refused up front (tests/arch_helpers.py:
the models and the checks)."""

from __future__ import annotations

import pytest
import torch
from arch_helpers import (
    NEW,
    _measurement_cache,  # noqa: F401 (an autouse fixture)
    check_hf_greedy,
    check_logits,
    gemma3_image_text,
    hf_greedy,
    prompts,
    self_greedy,
)

from hf_selfspec import attach_heads

CASES = {
    # norms scaling by 1 + w, GELU (tanh), the embedding scaled by sqrt(hidden); untied: a
    # random tied model repeats its last token
    "gemma": dict(arch="Gemma", head_dim=16, tie_word_embeddings=False),
    "gemma-mqa-tied": dict(arch="Gemma", head_dim=16, num_key_value_heads=1),
    # norms on both sides of each block, soft caps on the attention scores and the logits
    # (small here, so that they change the tokens), query_pre_attn_scalar, a window
    "gemma2": dict(arch="Gemma2", head_dim=16, tie_word_embeddings=False, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, query_pre_attn_scalar=24, sliding_window=256),
    # per-head q/k norms scaling by 1 + w, a RoPE per layer type (here far apart: base 10 in
    # the sliding layers, linear scaling in the full ones)
    "gemma3": dict(arch="Gemma3Text", model_class="Gemma3ForCausalLM", head_dim=16, tie_word_embeddings=False,
                   query_pre_attn_scalar=24, sliding_window=256, layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                    "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    # VaultGemma: Gemma 2 without the blocks' output norms (soft caps, a window)
    "vaultgemma": dict(arch="VaultGemma", head_dim=16, tie_word_embeddings=False, attn_logit_softcapping=5.0,
                       final_logit_softcapping=3.0, query_pre_attn_scalar=24, sliding_window=256, random_norms=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_supported_variant_gives_hf_greedy(case):
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    check_hf_greedy(CASES[case])


@pytest.mark.parametrize("case", ["gemma", "gemma2", "gemma3", "vaultgemma"])
def test_logits_are_hfs_to_float32_rounding(case):
    """output_logits equal HF's to float32 rounding: what the tokens alone may not show (a
    GELU without the tanh approximation, a soft cap left off the logits: the argmax
    survives both)."""
    check_logits(CASES[case])


def test_gemma3_image_text_class_decodes_its_text():
    """Text prompts, alone and as a batch, within its window and past it: HF's greedy output;
    the engine reads the language model's layers and the text config's window."""
    model = gemma3_image_text()
    rows = prompts(11, 30, 120)
    expected = [hf_greedy(model, p) for p in rows]
    attach_heads(model, heads=False)
    assert [self_greedy(model, [p])[0] for p in rows] == expected
    assert self_greedy(model, rows) == expected
    assert model._selfspec.engine.view.layer_window == (32, 0)
    # the processor's token_type_ids of a text prompt (all 0) are the text's own
    ids = torch.tensor(rows[:1])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids),
                         do_sample=False, max_new_tokens=NEW, pad_token_id=0, assistant="self")
    assert out[0, ids.shape[1]:].tolist()[:len(expected[0])] == expected[0]


@pytest.mark.parametrize("media", ["pixel_values", "token_type_ids"])
def test_gemma3_image_inputs_refused(media):
    """An image (its pixels, or token_type_ids marking image tokens) would be dropped by the
    engine: refused by name, before HF encodes it."""
    model = gemma3_image_text()
    attach_heads(model, heads=False)
    ids = torch.tensor(prompts(12))
    kw = {"pixel_values": torch.zeros(1, 3, 28, 28),
          "token_type_ids": torch.zeros_like(ids).index_fill_(1, torch.tensor([3, 4]), 1)}
    encoded = []
    model.model.vision_tower.register_forward_hook(lambda *args: encoded.append(1))
    with pytest.raises(ValueError, match=f"{media} is not supported with assistant='self'.*text only"):
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4,
                       assistant="self", **{media: kw[media]})
    assert not encoded
