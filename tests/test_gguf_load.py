"""A GGUF file loaded the way transformers documents it (`from_pretrained(folder,
gguf_file=...)`): float32 weights dequantised from the file's blocks, with a GGUF
quantization_config and quantizer left on the model. attach_heads takes it as it comes,
reads its projections in their compact block form and decodes HF greedy's tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, tiny_model
from transformers import AutoModelForCausalLM, GgufConfig

import hf_selfspec
from hf_selfspec import attach_heads
from hf_selfspec.defaults import gguf_path
from hf_selfspec.engine.layered import LayeredModel, UnsupportedModelError

NEW_TOKENS = 32
QUESTION = "Write a Python function that returns the squares of a list of numbers."


def test_gguf_marker_accepted_only_with_float_weights():
    """The GGUF marker (as a dict or transformers' GgufConfig, with its quantizer) is no
    refusal by itself; a projection whose weight is not float still is."""
    model = tiny_model("llama", seed=0)
    model.config.quantization_config = {"quant_method": "gguf"}
    LayeredModel._check_features(model.config, 1)  # what attach_heads calls first
    model.config.quantization_config = GgufConfig()
    model.hf_quantizer = type("GgufHfQuantizer", (), {"quantization_config": GgufConfig()})()
    LayeredModel.check_supported(model)
    k_proj = model.model.layers[1].self_attn.k_proj
    k_proj.weight = torch.nn.Parameter(k_proj.weight.to(torch.int8), requires_grad=False)
    with pytest.raises(UnsupportedModelError, match="k_proj .*int8"):
        LayeredModel.check_supported(model)


@pytest.mark.slow
def test_gguf_loaded_model_attaches_and_decodes_exactly(default_model):
    _, tokenizer = default_model  # the same tokenizer; loading it from the GGUF is slower
    path = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    # what a user gets from transformers' loader: the marker the engine used to refuse
    assert str(model.config.quantization_config.quant_method.value) == "gguf"
    assert model.hf_quantizer is not None and model.dtype == torch.float32
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = hf_greedy(model, prompt, NEW_TOKENS, tokenizer.eos_token_id)

    attach_heads(model)  # the embedded model's own weights: its shipped heads apply
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         assistant="self")
    assert out[0, len(prompt):].tolist() == ref
    engine = model._selfspec.engine
    # Q4_1 blocks: every projection is read compactly where the row kernel runs
    assert engine.layout.name != "kernel" or engine.compact.count == 7 * model.config.num_hidden_layers
    assert model._selfspec.heads is not None and model.selfspec_stats.new_tokens == len(ref)


@pytest.mark.slow
def test_default_model_path_loads_with_plain_transformers(default_model):
    """hf_selfspec.default_model_path(): the embedded model's folder, loaded as any checkpoint
    (no heads attached, no quantization marker), the same weights load_default() gives."""
    reference, _ = default_model
    model = AutoModelForCausalLM.from_pretrained(hf_selfspec.default_model_path())
    assert getattr(model.config, "quantization_config", None) is None and "_selfspec" not in model.__dict__
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
