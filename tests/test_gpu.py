"""CUDA-graph runner: graph replay == eager bit for bit, speculative == AR on CUDA.

The CUDA tests skip without a GPU ("needs a CUDA GPU"); run them with scripts/gpu_check.sh.
The CPU tests check what a CPU can: the refusal, the runner's plumbing with an eager
stand-in for CUDA graphs, and the Triton attention hook (interpreter) against a direct
softmax.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_model

import hf_selfspec.engine.cuda_graphs as runner_module
from hf_selfspec.decoding.cycle import DecodeConfig, SelfSpecDecoder
from hf_selfspec.engine.attention import triton_attention
from hf_selfspec.engine.core import Engine, EngineConfig
from hf_selfspec.engine.cuda_graphs import CudaGraphRunner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16, torch.float32]
HIDDEN = 128
KEYS = [("seg", 0, 2), ("seg", 2, 4), ("seg", 1, 3), ("verify", 0), ("verify", 2),
        ("verify", 4), ("ar",)]
# positions around the engine's key blocks (256) and the kernel's (64); rows 1..W
POSITIONS = (0, 63, 255, 256, 300, 700)
ROWS = (1, 3, 8)


def _engine(device, dtype=torch.float32, width=8, capacity=1024, kind="llama") -> Engine:
    model = tiny_model(kind, seed=0, layers=4, vocab=256, hidden=HIDDEN).to(device, dtype)
    return Engine(model, EngineConfig(width=width, capacity=capacity, row_layout="fixed"))


def _random_cache(engine, seed=0):
    """A filled KV cache (random keys and values at every slot)."""
    gen = torch.Generator(device=engine.k_cache.device).manual_seed(seed)
    engine.k_cache.normal_(generator=gen)
    engine.v_cache.normal_(generator=gen)
    return gen


def _assert_graphs_equal_eager(engine, runner, gen, positions, rows, keys):
    """For every position and row count: seg/verify/ar through the runner == eager, bits and
    the KV written. No capture happens after warmup (one graph per key serves all)."""
    H = engine.view.hidden_size
    device, dtype = engine.k_cache.device, engine.view.dtype
    for position in positions:
        for n in rows:
            h = torch.randn(n, H, generator=gen, device=device).to(dtype)
            meta = engine.make_meta(range(position, position + n))
            written = (slice(None), slice(None), slice(position, position + n))
            for key in keys:
                if key[0] == "seg":
                    eager = (engine.seg(h, key[1], key[2], meta),)
                    kv = engine.k_cache[written].clone(), engine.v_cache[written].clone()
                    graph = (runner.seg(h, key[1], key[2], meta),)
                    assert torch.equal(kv[0], engine.k_cache[written]), (key, position, n)
                    assert torch.equal(kv[1], engine.v_cache[written]), (key, position, n)
                elif key[0] == "verify":
                    eager = engine.verify(h, key[1], meta)
                    graph = runner.verify(h, key[1], meta)
                else:
                    continue
                for e, g in zip(eager, graph):
                    assert torch.equal(e, g), (key, position, n)
        if ("ar",) in keys:
            e_logits, e_token, e_final = engine.ar_step(11, position)
            g_logits, g_token, g_final = runner.ar_step(11, position)
            assert torch.equal(e_logits, g_logits) and e_token == g_token, position
            assert torch.equal(e_final, g_final), position


# ---- CPU -----------------------------------------------------------------------------------


def test_runner_refuses_cpu_engine():
    engine = _engine("cpu", width=4, capacity=64)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        CudaGraphRunner(engine)


class _EagerGraph:
    """Stand-in for a captured CUDA graph: a replay reruns the body into the same outputs."""

    def __init__(self, body):
        self.body = body
        self.outputs = body()

    def replay(self):
        for out, new in zip(self.outputs, self.body()):
            out.copy_(new)


def test_runner_plumbing_with_stand_in_graphs(monkeypatch):
    """Static buffers, metadata read from the device buffer (full-capacity masks on CPU),
    one program per key for all positions and rows, attached() routing: all on the CPU."""
    monkeypatch.setattr(runner_module, "_require_cuda", lambda engine: None)
    monkeypatch.setattr(CudaGraphRunner, "_record",
                        lambda self, body: ((g := _EagerGraph(body)), g.outputs))
    engine = _engine("cpu", width=4, capacity=320)
    gen = _random_cache(engine)
    runner = CudaGraphRunner(engine)
    keys = [("seg", 0, 2), ("verify", 2), ("verify", 0), ("ar",)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.warmup(keys)
    _assert_graphs_equal_eager(engine, runner, gen, (0, 255, 300), (1, 4), keys)
    assert runner.captured == keys and not runner.eager
    prompt = list(range(3, 40)) + list(range(3, 12))
    reference = engine.generate_ar(prompt, 16)
    with runner.attached():
        assert engine.generate_ar(prompt, 16) == reference
        spec = SelfSpecDecoder(engine, None, DecodeConfig(lookup="only")).generate(prompt, 16)
    assert spec.tokens == reference
    assert "seg" not in vars(engine) and "ar_step" not in vars(engine)


def test_graph_executor_refuses_cpu_engine():
    model = tiny_model("llama", seed=0, layers=2, vocab=256, hidden=HIDDEN)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Engine(model, EngineConfig(width=4, capacity=64, row_layout="fixed", executor="cuda_graphs"))


def test_engine_built_with_the_graph_executor(monkeypatch):
    """EngineConfig(executor="cuda_graphs"): the engine's programs are the runner's for its
    lifetime; growing the KV cache drops the captured programs (they replay the old cache's
    addresses) and decoding stays exact. On the CPU with stand-in graphs."""
    monkeypatch.setattr(runner_module, "_require_cuda", lambda engine: None)
    monkeypatch.setattr(CudaGraphRunner, "_record",
                        lambda self, body: ((g := _EagerGraph(body)), g.outputs))
    model = tiny_model("llama", seed=0, layers=4, vocab=256, hidden=HIDDEN)
    eager = Engine(model, EngineConfig(width=4, capacity=512, row_layout="fixed"))
    engine = Engine(model, EngineConfig(width=4, capacity=64, row_layout="fixed", executor="cuda_graphs"))
    assert engine.graphs is not None and vars(engine)["verify"] == engine.graphs.verify
    prompt = list(range(3, 30))
    assert engine.generate_ar(prompt, 16) == eager.generate_ar(prompt, 16)
    assert ("ar",) in engine.graphs.captured
    engine.ensure_capacity(300)
    assert engine.graphs.captured == []
    long_prompt = list(range(3, 120)) + list(range(3, 60))
    assert engine.generate_ar(long_prompt, 40) == eager.generate_ar(long_prompt, 40)
    spec = SelfSpecDecoder(engine, None, DecodeConfig(lookup="only")).generate(long_prompt, 40)
    assert spec.tokens == eager.generate_ar(long_prompt, 40)


def test_runner_rejects_unknown_keys(monkeypatch):
    monkeypatch.setattr(runner_module, "_require_cuda", lambda engine: None)
    runner = CudaGraphRunner(_engine("cpu", width=4, capacity=64))
    for key in [("seg", 2, 2), ("seg", 0, 5), ("verify", 5), ("fill", 0, 1)]:
        with pytest.raises(ValueError, match="unknown program key"):
            runner.warmup([key])
    assert runner.decoding_keys([2]) == [("seg", 0, 2), ("verify", 0), ("verify", 2), ("ar",)]


def test_triton_attention_matches_softmax():
    """The hook's arguments (prefix = key limit + 1, [R, Hq, d] queries, GQA heads) against
    a direct softmax; on the CPU through the Triton interpreter (set by conftest)."""
    pytest.importorskip("triton", reason="triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = _engine(device, width=4, capacity=320)
    gen = _random_cache(engine)
    v = engine.view
    positions = [70, 71, 299, 5]  # row limits in different key blocks
    meta = engine.make_meta(positions)
    q = torch.randn(v.num_heads, engine.width, v.head_dim, generator=gen, device=device)
    out = triton_attention(engine, meta)(q, 1).view(engine.width, v.num_heads, v.head_dim)
    for r, limit in enumerate(positions):
        for head in range(v.num_heads):
            kv_head = head // engine.group
            keys = engine.k_cache[1, kv_head, : limit + 1]
            weights = torch.softmax(keys @ q[head, r] * v.scaling, dim=0)
            expected = weights @ engine.v_cache[1, kv_head, : limit + 1]
            torch.testing.assert_close(out[r, head], expected, atol=1e-5, rtol=1e-5)
    # with fewer real rows, the real rows keep their bits and the pad rows see no key
    fewer = triton_attention(engine, engine.make_meta(positions[:2]))(q, 1)
    assert torch.equal(fewer[:2], out[:2].reshape(2, -1))
    assert not fewer[2:].any()


# ---- the executor of generate(assistant="self") (CPU, stand-ins) ---------------------------


def test_executor_choice_by_device():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device objects: nothing runs
    assert runner_module.resolve_executor("auto", cuda) == "cuda_graphs"
    assert runner_module.resolve_executor("auto", cpu) == "eager"
    assert runner_module.resolve_executor("eager", cuda) == "eager"  # an explicit choice stays
    assert runner_module.resolve_executor("cuda_graphs", cpu) == "cuda_graphs"


def _generate_with(model, executor, prompt, new_tokens):
    """generate(assistant="self") on an attached tiny model whose EngineConfig asks for
    `executor`; returns (tokens, the state's engine, our RuntimeWarnings)."""
    from hf_selfspec import attach_heads

    attach_heads(model, heads=False, engine=EngineConfig(width=4, capacity=256, row_layout="fixed",
                                                         executor=executor))
    ids = torch.tensor([prompt])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               do_sample=False, assistant="self", pad_token_id=0) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    ours = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
            and ("CUDA graph" in str(w.message) or "CUDA-graph" in str(w.message))]
    return outs[0][0, len(prompt):].tolist(), model._selfspec.engine, ours


def test_generate_runs_the_graph_executor_where_it_is_the_default(monkeypatch):
    """Where graphs are the default, generate() builds the engine with the graph executor
    (stand-in graphs on the CPU), decodes exactly, and keeps an explicit "eager"."""
    monkeypatch.setattr(runner_module, "graphs_by_default", lambda device: True)
    monkeypatch.setattr(runner_module, "_require_cuda", lambda engine: None)
    monkeypatch.setattr(CudaGraphRunner, "_record",
                        lambda self, body: ((g := _EagerGraph(body)), g.outputs))
    model = tiny_model("llama", seed=0, layers=2, vocab=256, hidden=HIDDEN)
    prompt = list(range(3, 40)) + list(range(3, 12))
    reference = Engine(model, EngineConfig(width=4, capacity=256, row_layout="fixed")).generate_ar(prompt, 12)
    tokens, engine, warned = _generate_with(model, "auto", prompt, 12)
    assert tokens == reference and not warned
    assert engine.config.executor == "cuda_graphs" and ("verify", 0) in engine.graphs.captured
    tokens, engine, warned = _generate_with(model, "eager", prompt, 12)
    assert tokens == reference and engine.graphs is None and not warned


def test_generate_falls_back_to_eager_with_one_warning(monkeypatch):
    """A capture that fails (stand-in runner whose capture raises): one RuntimeWarning over
    two calls, the same tokens. A graph executor that cannot be set up at all (the real
    runner refuses a CPU engine): one warning, an eager engine, the same tokens."""
    monkeypatch.setattr(runner_module, "graphs_by_default", lambda device: True)
    model = tiny_model("llama", seed=0, layers=2, vocab=256, hidden=HIDDEN)
    prompt = list(range(3, 40)) + list(range(3, 12))
    reference = Engine(model, EngineConfig(width=4, capacity=256, row_layout="fixed")).generate_ar(prompt, 12)
    tokens, engine, warned = _generate_with(model, "auto", prompt, 12)
    assert tokens == reference and engine.graphs is None and engine.config.executor == "eager"
    assert len(warned) == 1 and "could not be set up" in warned[0], warned

    def broken(self, body):
        raise RuntimeError("no capture today")

    monkeypatch.setattr(runner_module, "_require_cuda", lambda engine: None)
    monkeypatch.setattr(CudaGraphRunner, "_record", broken)
    tokens, engine, warned = _generate_with(model, "auto", prompt, 12)
    assert tokens == reference and engine.graphs.eager and "no capture today" in engine.graphs.fallback_reason
    assert len(warned) == 1 and warned[0].startswith("CUDA graph capture of"), warned


# ---- CUDA ----------------------------------------------------------------------------------


def _cuda_runner(engine, keys):
    runner = CudaGraphRunner(engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a capture failure must fail the test, not fall back
        runner.warmup(keys)
    assert not runner.eager, runner.fallback_reason
    assert runner.captured == keys
    return runner


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_replay_equals_eager(dtype):
    engine = _engine("cuda", dtype)
    gen = _random_cache(engine)
    runner = _cuda_runner(engine, KEYS)
    _assert_graphs_equal_eager(engine, runner, gen, POSITIONS, ROWS, KEYS)
    assert runner.captured == KEYS  # replayed at every position and row count, never recaptured


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
# unrotated layers, fused weights, multipliers, output norms, Gemma (its soft-capped Gemma 2 is
# refused on CUDA)
@pytest.mark.parametrize("kind", ["llama", "smollm3", "phi3", "granite", "olmo2", "gemma"])
def test_speculative_equals_ar_on_cuda(dtype, kind):
    engine = _engine("cuda", dtype, kind=kind)
    runner = _cuda_runner(engine, runner_keys := [("verify", 0), ("ar",)])
    # every token below 120 is in the prompt: prompt lookup drafts after most tokens
    prompt = list(range(3, 120)) + list(range(3, 40))
    reference = engine.generate_ar(prompt, 48)
    with runner.attached():
        graphs_ar = engine.generate_ar(prompt, 48)
        spec = SelfSpecDecoder(engine, None, DecodeConfig(lookup="only")).generate(prompt, 48)
    assert graphs_ar == reference
    assert spec.tokens == reference
    assert spec.stats.drafted > 0  # verification of several rows did happen
    assert runner.captured == runner_keys and not runner.eager


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_executor_on_cuda_is_exact_across_cache_growth(dtype):
    """An engine built with the CUDA-graph executor: AR and speculative tokens equal the
    eager engine's, before and after its KV cache grows (graphs captured again)."""
    model = tiny_model("llama", seed=0, layers=4, vocab=256, hidden=HIDDEN).to("cuda", dtype)
    eager = Engine(model, EngineConfig(width=8, capacity=1024, row_layout="fixed"))
    engine = Engine(model, EngineConfig(width=8, capacity=256, executor="cuda_graphs"))
    assert engine.layout.name == "fixed" and engine.graphs is not None
    prompt = list(range(3, 120)) + list(range(3, 40))
    assert engine.generate_ar(prompt, 48) == eager.generate_ar(prompt, 48)
    engine.ensure_capacity(900)
    long_prompt = prompt * 4
    reference = eager.generate_ar(long_prompt, 48)
    assert engine.generate_ar(long_prompt, 48) == reference
    spec = SelfSpecDecoder(engine, None, DecodeConfig(lookup="only")).generate(long_prompt, 48)
    assert spec.tokens == reference and not engine.graphs.eager


@needs_cuda
def test_capture_failure_falls_back_with_one_warning(monkeypatch):
    engine = _engine("cuda", torch.bfloat16)
    gen = _random_cache(engine)

    def broken(self, body):
        raise RuntimeError("no capture today")

    monkeypatch.setattr(CudaGraphRunner, "_record", broken)
    runner = CudaGraphRunner(engine)
    h = torch.randn(3, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    meta = engine.make_meta([40, 41, 42])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = runner.seg(h, 0, 2, meta)
        again = runner.verify(h, 0, meta)
    ours = [str(w.message) for w in caught if "CUDA graph capture" in str(w.message)]
    assert len(ours) == 1 and ours[0].startswith("CUDA graph capture of ('seg', 0, 2) failed")
    assert runner.eager and "no capture today" in runner.fallback_reason
    assert torch.equal(first, engine.seg(h, 0, 2, meta))
    assert all(torch.equal(a, b) for a, b in zip(again, engine.verify(h, 0, meta)))
