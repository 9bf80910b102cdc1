"""Compact weights (engine/compact.py; cpu_rows.cpp, "compact weights"): float32 matrices
that hold exact GGUF Q4_1, Q4_0 or Q8_0 blocks (made here by gguf's own quantizers and
dequantizers, what such a file loaded through transformers holds) are read in that form, with
every product, layer and step bit for bit the float32 one; any matrix that is not exactly
that stays float32; the forms follow in-place updates of the weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_greedy, tiny_model
from gguf import GGMLQuantizationType, quants
from hf_selfspec.kernels.cpu_rows import (
    build_error,
    load_rows_compact,
    load_rows_layer,
    load_rows_linear,
    use_avx512,
    use_work_pool,
)
from test_engine_memory import _model_storages, _weights_the_engine_reads
from test_kernels_cpu import _call, _has_avx512, _layer_case

from hf_selfspec import attach_heads
from hf_selfspec.engine.compact import PROJECTIONS
from hf_selfspec.engine.core import Engine, EngineConfig

# the block formats kept, and the bytes of a block of 32 weights in each form
FORMS = {"Q4_1": 24, "Q4_0": 20, "Q8_0": 36}


def gguf_round_trip(w: torch.Tensor, form: str = "Q4_1") -> torch.Tensor:
    """w through gguf's quantizer and dequantizer of `form`: what a GGUF file of that form
    loaded through transformers holds (float32)."""
    kind = GGMLQuantizationType[form]
    a = w.detach().float().contiguous().numpy()
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(quants.quantize(a, kind), kind))).reshape(w.shape)


def q4_1(w: torch.Tensor) -> torch.Tensor:
    return gguf_round_trip(w, "Q4_1")


@pytest.fixture(scope="module")
def kernels():
    compact, linear = load_rows_compact(), load_rows_linear()
    assert compact is not None, f"the kernel did not build on an AVX2 machine: {build_error()}"
    return compact, linear


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pool, avx512", [(False, False), (False, True), (True, True)],
                         ids=["openmp-8lane", "openmp-avx512", "pool-avx512"])
@pytest.mark.parametrize("k, o", [(32, 1), (64, 5), (96, 13), (576, 37), (1536, 1000)])  # tiles' and splits' tails
def test_compact_products_equal_float32_products_bit_for_bit(kernels, k, o, pool, avx512, form):
    """Every x-row tile (on an AVX-512 CPU, blocks of 7-8 rows in 32 registers too) against
    the float32 product, bit for bit."""
    if avx512 and not _has_avx512():
        pytest.skip("this CPU has no AVX-512 F/DQ/BW/VL: only the 8-lane tiles run here")
    compact, linear = kernels
    gen = torch.Generator().manual_seed(k * 1000 + o)
    a = torch.randn(o, k, generator=gen)
    if o > 1:  # an all-zero block (Q4_0 dequantizes it to -0.0; alone, any form would hold it)
        a[0, :32] = 0.0
    w = gguf_round_trip(a, form)
    packed = compact(w)
    # the first form that holds every block is kept: one block alone may fit Q4_1 too
    widths = [k // 32 * FORMS[form]] if o > 1 else [k // 32 * b for b in FORMS.values()]
    assert packed.dtype == torch.uint8 and packed.shape[0] == o and packed.shape[1] in widths
    previous = use_work_pool(pool)
    try:
        assert use_avx512(avx512) is avx512
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 17):  # every x-row tile, and blocks of 8 rows
            x = torch.randn(rows, k, generator=gen)
            assert torch.equal(linear(x, packed), linear(x, w)), rows
    finally:
        use_work_pool(previous)
        use_avx512(True)


def test_compact_form_only_where_every_weight_comes_back(kernels):
    compact, linear = kernels
    gen = torch.Generator().manual_seed(1)
    w = q4_1(torch.randn(8, 64, generator=gen))
    assert compact(w).numel() > 0
    assert compact(torch.randn(8, 64, generator=gen)).numel() == 0  # trained float32 weights
    for other in ("Q5_0", "Q5_1"):  # 5-bit codes: no form for them
        assert compact(gguf_round_trip(torch.randn(8, 64, generator=gen), other)).numel() == 0
    nudged = w.clone()
    nudged[3, 17] = torch.nextafter(nudged[3, 17], torch.tensor(float("inf")))  # one weight one ulp off
    assert compact(nudged).numel() == 0
    assert compact(w[:, :48].contiguous()).numel() == 0  # rows not whole blocks of 32
    bad = w.clone()
    bad[0, 0] = float("nan")
    assert compact(bad).numel() == 0
    flat = w.clone()
    flat[2, 32:] = 0.25  # a constant block: d = 0
    packed = compact(flat)
    x = torch.randn(3, 64, generator=gen)
    assert packed.numel() > 0 and torch.equal(linear(x, packed), linear(x, flat))
    with pytest.raises(RuntimeError, match="float32"):
        compact(w.bfloat16())
    with pytest.raises(RuntimeError, match="compact"):  # a compact form of other columns, before any work
        linear(torch.randn(1, 96), compact(w))


def test_compact_layer_equals_float32_layer_bit_for_bit(kernels):
    layer = load_rows_layer()
    gen = torch.Generator().manual_seed(2)
    case = _layer_case(gen, H=64, Hq=4, Hkv=2, d=16, inter=96, S=40, R=5, qk_norm=True)
    for n, i in enumerate(PROJECTIONS):  # the three forms side by side in one layer
        case["weights"][i] = gguf_round_trip(case["weights"][i], list(FORMS)[n % 3])
    compacted = list(case["weights"])
    for i in PROJECTIONS:
        compacted[i] = kernels[0](case["weights"][i])
        assert compacted[i].numel() > 0
    reference = _call(layer, {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()})
    assert torch.equal(_call(layer, case, weights=compacted), reference)
    compacted[4] = kernels[0](case["weights"][2])  # k's form where o's belongs: other rows
    with pytest.raises(RuntimeError, match="the o weight"):
        _call(layer, case, weights=compacted)


def _q4_model(seed: int = 3, layers: int = 3):
    """A tiny Llama whose projections went through GGUF round trips (Q4_1, Q4_0 and Q8_0 in turn,
    as a mixed-format file has them)."""
    model = tiny_model("llama", seed=seed, layers=layers)
    with torch.no_grad():
        n = 0
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.weight.copy_(gguf_round_trip(lin.weight, list(FORMS)[n % 3]))
                n += 1
    return model


def test_engine_reads_a_q4_1_model_compactly_exactly_and_without_a_second_copy():
    model = _q4_model()
    engine = Engine(model, EngineConfig(width=8, capacity=256, row_layout="kernel"))
    compact = engine.compact
    assert compact is not None and compact.count == 7 * 3
    prompt = list(range(3, 40))
    assert engine.generate_ar(prompt, 24) == hf_greedy(model, prompt, 24)
    # one step's logits read compactly, then again (same slot) from the float32 weights
    logits, _token, _ = engine.ar_step(17, len(prompt))
    engine._fused_weights = compact.source
    assert torch.equal(engine.ar_step(17, len(prompt))[0], logits)
    engine._fused_weights = compact.kernel_weights
    # beyond the model's storage the engine holds only the compact forms: 20-36 bytes per 128
    storages, forms = _model_storages(model), {id(t) for t in compact.kernel_weights}
    copies = [t for _path, t in _weights_the_engine_reads(engine) if t.untyped_storage().data_ptr() not in storages]
    assert copies and all(id(t) in forms for t in copies)
    matrices = sum(compact.source[i].numel() * 4 for i in compact.indices)
    assert matrices * 20 // 128 < compact.copy_bytes < matrices * 36 // 128
    assert compact.read_bytes_saved == matrices - compact.copy_bytes


def test_compact_forms_follow_in_place_updates():
    model = _q4_model(seed=4)
    attach_heads(model, heads=False)
    prompt = torch.tensor([list(range(5, 30))])

    def both():
        ours = model.generate(prompt, max_new_tokens=20, do_sample=False, assistant="self", pad_token_id=0)
        assert ours[0, prompt.shape[1]:].tolist() == hf_greedy(model, prompt[0].tolist(), 20)

    both()
    engine = model._selfspec.engine
    assert engine.compact.count == 7 * 3
    gen = torch.Generator().manual_seed(5)
    up = model.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        up.copy_(q4_1(torch.randn(up.shape, generator=gen)))  # new Q4_1 values, same storage
    both()
    q = model.model.layers[2].self_attn.q_proj.weight
    with torch.no_grad():
        q.add_(1e-3 * torch.randn(q.shape, generator=gen))  # no longer Q4_1: read as float32
    both()
    assert model._selfspec.engine is engine and engine.compact.count == 7 * 3 - 1
