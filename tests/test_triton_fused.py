"""Fused small kernels (kernels/fused.py): against the PyTorch ops the engine uses, and row
invariance bit for bit. On the CPU through the Triton interpreter.

Agreement, per op (the kernels' docstring says why):
  - residual add and RoPE (+ the KV write): exact (torch.equal) in fp32, bf16 and fp16;
  - RMSNorm: its sum of squares runs in another order than PyTorch's, so fp32 within
    rtol 1e-5 (a few ulp), bf16 / fp16 within 2 ulp of the dtype (rtol 2^-6 / 2^-9).
Row invariance: a row's outputs are the same bits alone, among 3 rows and among 8.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

from hf_selfspec.kernels.fused import add_rms_norm, rope_kv_write

from hf_selfspec.engine.layered import rms_norm, rotate_half

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# RMSNorm tolerance per dtype (relative; 2 ulp of the 16-bit types)
NORM_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9}
EPS = 1e-5


def _randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 100])  # SmolLM2's width; a width that is no power of two
def test_add_rms_norm_matches_the_engine_ops(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    h, delta = _randn(gen, 5, hidden, dtype=dtype, scale=3.0), _randn(gen, 5, hidden, dtype=dtype)
    weight = _randn(gen, hidden, dtype=dtype)
    summed, x = add_rms_norm(h, weight, EPS, delta)
    assert torch.equal(summed, h + delta)  # the residual add: the same op, the same bits
    expected = rms_norm(h + delta, weight, EPS)
    torch.testing.assert_close(x, expected, rtol=NORM_RTOL[dtype], atol=1e-6)
    same, x_alone = add_rms_norm(h, weight, EPS)
    assert same is h
    torch.testing.assert_close(x_alone, rms_norm(h, weight, EPS), rtol=NORM_RTOL[dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_is_row_invariant(dtype):
    gen = torch.Generator().manual_seed(1)
    h, delta = _randn(gen, 8, 576, dtype=dtype), _randn(gen, 8, 576, dtype=dtype)
    weight = _randn(gen, 576, dtype=dtype)
    summed, x = add_rms_norm(h, weight, EPS, delta)
    for rows in (slice(2, 3), slice(5, 8)):
        part_sum, part_x = add_rms_norm(h[rows], weight, EPS, delta[rows])
        assert torch.equal(part_sum, summed[rows]) and torch.equal(part_x, x[rows])


def _rope_case(gen, rows, dtype, num_q=4, num_kv=2, dim=64, slots=40):
    q = _randn(gen, rows, num_q, dim, dtype=dtype)
    k = _randn(gen, rows, num_kv, dim, dtype=dtype)
    v = _randn(gen, rows, num_kv, dim, dtype=dtype)
    angles = torch.rand(rows, dim // 2, generator=gen) * 6.0
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    caches = [_randn(gen, num_kv, slots, dim, dtype=dtype) for _ in range(2)]
    return q, k, v, cos, sin, caches


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_kv_write_matches_the_engine_ops_exactly(dtype):
    gen = torch.Generator().manual_seed(2)
    q, k, v, cos, sin, (k_cache, v_cache) = _rope_case(gen, 5, dtype)
    slots = torch.tensor([7, 3, 30, 31, 12], device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    q_out = rope_kv_write(q, k, v, cos, sin, slots, k_cache, v_cache)
    # the engine's ops: heads first, cos/sin broadcast over the heads
    qt, kt = q.transpose(0, 1), k.transpose(0, 1)
    c, s = cos[None], sin[None]
    q_ref = qt * c + rotate_half(qt) * s
    k_ref = kt * c + rotate_half(kt) * s
    expected_k.index_copy_(1, slots, k_ref)
    expected_v.index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(q_out.transpose(0, 1), q_ref)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)  # other slots untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_kv_write_is_row_invariant(dtype):
    gen = torch.Generator().manual_seed(3)
    q, k, v, cos, sin, (k_cache, v_cache) = _rope_case(gen, 8, dtype)
    slots = torch.arange(10, 18, device=DEVICE)
    full_k, full_v = k_cache.clone(), v_cache.clone()
    q_all = rope_kv_write(q, k, v, cos, sin, slots, full_k, full_v)
    for rows in (slice(0, 1), slice(4, 7)):
        part_k, part_v = k_cache.clone(), v_cache.clone()
        q_part = rope_kv_write(q[rows], k[rows], v[rows], cos[rows], sin[rows], slots[rows], part_k, part_v)
        assert torch.equal(q_part, q_all[rows])
        written = slots[rows]
        assert torch.equal(part_k[:, written], full_k[:, written])
        assert torch.equal(part_v[:, written], full_v[:, written])


def test_bad_inputs_are_refused():
    gen = torch.Generator().manual_seed(4)
    h = _randn(gen, 2, 8)
    with pytest.raises(ValueError, match="share a float dtype"):
        add_rms_norm(h, _randn(gen, 8, dtype=torch.bfloat16), EPS)
    with pytest.raises(ValueError, match="delta must match"):
        add_rms_norm(h, _randn(gen, 8), EPS, _randn(gen, 3, 8))
    q, k, v, cos, sin, (k_cache, v_cache) = _rope_case(gen, 2, torch.float32)
    with pytest.raises(ValueError, match="slots"):
        rope_kv_write(q, k, v, cos, sin, torch.zeros(3, dtype=torch.long), k_cache, v_cache)
    with pytest.raises(ValueError, match="one dtype"):
        rope_kv_write(q, k, v, cos.double(), sin, torch.zeros(2, dtype=torch.long), k_cache, v_cache)


# ---- in the engine (Engine.fused_small_ops, opt-in) ------------------------------------------


def _engine(fused, executor="eager", dtype=torch.float32):
    from conftest import tiny_model

    from hf_selfspec.engine.attention import TritonAttention
    from hf_selfspec.engine.core import Engine, EngineConfig

    model = tiny_model("llama", seed=0, layers=2).to(DEVICE, dtype)
    engine = Engine(model, EngineConfig(width=8, capacity=300, row_layout="fixed", executor=executor,
                                        measurement_cache=False))
    engine.attention = TritonAttention()
    engine.fused_small_ops = fused
    return engine


def test_fused_engine_step_is_row_and_segment_invariant_and_close_to_unfused():
    """A fused verify step: rows alone == rows among 8 (bits), seg(0, 1) + verify(1) ==
    verify(0) (bits: the pending MLP add), logits close to the unfused engine's (fp32)."""
    fused, plain = _engine(True), _engine(False)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 256, (20,), generator=gen).tolist()
    tokens = torch.randint(3, 256, (8,), generator=gen).tolist()
    results = []
    for engine in (fused, plain):
        engine.prefill(prompt)
        meta = engine.make_meta(range(20, 28))
        results.append(engine.verify(engine.embed(tokens), 0, meta))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-4, atol=1e-4)
    fused.prefill(prompt)
    meta = fused.make_meta(range(20, 23))
    three = fused.verify(fused.embed(tokens[:3]), 0, meta)
    assert torch.equal(three[0], results[0][0][:3])
    fused.prefill(prompt)
    meta = fused.make_meta(range(20, 23))
    mid = fused.seg(fused.embed(tokens[:3]), 0, 1, meta)
    assert torch.equal(fused.verify(mid, 1, meta)[0], three[0])


def test_fused_engine_speculative_equals_ar_through_stand_in_graphs(monkeypatch):
    """Prompt-lookup speculative decoding on the fused engine == its AR tokens, eager and
    through the graph runner (stand-in graphs: logits bitwise the eager engine's)."""
    from test_gpu import _EagerGraph

    import hf_selfspec.engine.cuda_graphs as runner_module
    from hf_selfspec.decoding.cycle import DecodeConfig, SelfSpecDecoder
    from hf_selfspec.engine.cuda_graphs import CudaGraphRunner

    monkeypatch.setattr(runner_module, "_require_cuda", lambda engine: None)
    monkeypatch.setattr(CudaGraphRunner, "_record", lambda self, body: ((g := _EagerGraph(body)), g.outputs))
    prompt = list(range(3, 30)) + list(range(3, 12))
    eager = _engine(True)
    reference = eager.generate_ar(prompt, 8)
    spec = SelfSpecDecoder(eager, None, DecodeConfig(lookup="only")).generate(prompt, 8, collect_logits=True)
    assert spec.tokens == reference and spec.stats.drafted > 0
    graphs = _engine(True, executor="cuda_graphs")
    through = SelfSpecDecoder(graphs, None, DecodeConfig(lookup="only")).generate(prompt, 8, collect_logits=True)
    assert through.tokens == reference and not graphs.graphs.eager
    assert all(torch.equal(a, b) for a, b in zip(through.logits, spec.logits))
