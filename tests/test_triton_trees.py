"""Draft trees and batches on the Triton path (kernels/attention.py, `TritonAttention`).

The properties are bitwise: a tree row equals the chain row at its position, a row in a
sequence's KV region at `base` equals the sequence alone at slot 0, and tree decoding
through the engine (eager, and through the CUDA-graph runner with stand-in graphs) equals
the engine's own AR output. Without CUDA everything runs under the Triton interpreter on
CPU tensors (set before triton is imported), so the cases are small.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

pytest.importorskip("triton", reason="triton is not installed: the Triton kernel cannot run")

from conftest import tiny_model
from hf_selfspec.kernels.attention import row_attention
from hf_selfspec.kernels.reference import row_attention_reference
from test_decoding import prompt
from test_gpu import _EagerGraph

import hf_selfspec.engine.cuda_graphs as runner_module
from hf_selfspec.decoding.cycle import DecodeConfig, SelfSpecDecoder
from hf_selfspec.engine.attention import TritonAttention, select_attention
from hf_selfspec.engine.core import Engine, EngineConfig
from hf_selfspec.engine.cuda_graphs import CudaGraphRunner
from hf_selfspec.engine.layouts import FixedLayout
from hf_selfspec.engine.meta import StepRows
from hf_selfspec.heads.top import random_top_heads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HQ, HKV, D = 4, 2, 64


def _cache(gen, slots, dtype=torch.float32):
    k = torch.randn(HKV, slots, D, generator=gen).to(dtype)
    v = torch.randn(HKV, slots, D, generator=gen).to(dtype)
    return k, v


def _int32(values):
    return torch.as_tensor(values, dtype=torch.int32, device=DEVICE)


def _tree_case(gen, pos0, depth, slots, dtype):
    """A chain cache (a row at pos0 + depth sees slots [0, pos0 + depth]) and the same keys
    laid out as a tree: the prefix in place, the path's keys at scattered slots after it,
    every other slot NaN (another branch's keys must never be read)."""
    chain_k, chain_v = _cache(gen, slots, dtype)
    picks = torch.randperm(slots - pos0 - 1, generator=gen)[:depth] + pos0 + 1
    path = [pos0] + sorted(int(s) for s in picks)  # a tree's root row sits at slot pos0
    tree_k = torch.full_like(chain_k, float("nan"))
    tree_v = torch.full_like(chain_v, float("nan"))
    tree_k[:, :pos0], tree_v[:, :pos0] = chain_k[:, :pos0], chain_v[:, :pos0]
    for i, slot in enumerate(path):
        tree_k[:, slot], tree_v[:, slot] = chain_k[:, pos0 + i], chain_v[:, pos0 + i]
    return [t.to(DEVICE) for t in (chain_k, chain_v, tree_k, tree_v)], path


# the path inside the first key block, across a block edge, in the third block
@pytest.mark.parametrize("pos0, dtype", [(5, torch.float32), (61, torch.bfloat16), (130, torch.float32)])
def test_tree_row_is_bit_identical_to_the_chain_row(pos0, dtype):
    """A tree row (prefix pos0, path of depth + 1 slots) computes exactly what the chain
    row at position pos0 + depth computes; chain rows in the same call keep their bits."""
    gen = torch.Generator().manual_seed(pos0)
    for depth in (0, 2, 5):
        (chain_k, chain_v, tree_k, tree_v), path = _tree_case(gen, pos0, depth, 200, dtype)
        q = torch.randn(2, HQ, D, generator=gen).to(dtype).to(DEVICE)
        no_path = _int32([[-1]] * 2)
        chain = row_attention(q, chain_k, chain_v, _int32([pos0 + depth + 1] * 2), no_path, 0.125)
        anc = torch.full((2, 8), -1, dtype=torch.int32)
        anc[:, : depth + 1] = torch.tensor(path)
        tree = row_attention(q, tree_k, tree_v, _int32([pos0] * 2), anc.to(DEVICE), 0.125)
        assert not tree.isnan().any()
        assert torch.equal(tree, chain), (pos0, depth)
        # in one call over the chain cache: row 0 a tree row whose path is the chain's own
        # slots, row 1 a chain row: each as alone
        anc[0, : depth + 1] = torch.arange(pos0, pos0 + depth + 1)
        anc[1] = -1
        mixed = row_attention(q, chain_k, chain_v, _int32([pos0, pos0 + depth + 1]),
                              anc.to(DEVICE), 0.125)
        assert torch.equal(mixed, chain), (pos0, depth)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_with_a_base_equal_the_sequence_alone(dtype):
    """Batches: rows of three sequences, each in its own KV region, chains and tree paths
    mixed in one call, each row bit-identical to its sequence alone at slot 0, and the
    regions' neighbours (NaN) never read."""
    gen = torch.Generator().manual_seed(11)
    bases, lengths = [0, 150, 260], [70, 5, 129]
    k = torch.full((HKV, 420, D), float("nan"))
    v = torch.full((HKV, 420, D), float("nan"))
    alone = []
    for b, n in zip(bases, lengths):
        ka, va = _cache(gen, n + 8, dtype)
        k[:, b:b + n + 8], v[:, b:b + n + 8] = ka.float(), va.float()
        alone.append((ka.to(DEVICE), va.to(DEVICE)))
    k, v = k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)
    q = torch.randn(6, HQ, D, generator=gen).to(dtype).to(DEVICE)
    rows_seq = [0, 0, 1, 1, 2, 2]
    prefix = [lengths[s] - (i % 2) for i, s in enumerate(rows_seq)]
    path = torch.full((6, 3), -1, dtype=torch.int32)
    for i, s in enumerate(rows_seq):
        if i % 2:  # a tree row: the prefix minus its last key, then two slots after it
            path[i, :2] = torch.tensor([lengths[s] + 1, lengths[s] + 3])
    base = torch.tensor([bases[s] for s in rows_seq], dtype=torch.int32)
    absolute = path + torch.where(path >= 0, base[:, None], 0)
    batched = row_attention(q, k, v, _int32(prefix), absolute.to(DEVICE), 0.125, base.to(DEVICE))
    assert not batched.isnan().any()
    for i, s in enumerate(rows_seq):
        ka, va = alone[s]
        one = row_attention(q[i:i + 1], ka, va, _int32(prefix[i:i + 1]), path[i:i + 1].to(DEVICE), 0.125)
        assert torch.equal(batched[i], one[0]), i
        ref = row_attention_reference(q[i:i + 1], ka, va, _int32(prefix[i:i + 1]), path[i:i + 1].to(DEVICE), 0.125)
        torch.testing.assert_close(one.float(), ref.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_bad_base_is_refused():
    gen = torch.Generator().manual_seed(0)
    k, v = (t.to(DEVICE) for t in _cache(gen, 16))
    q = torch.randn(2, HQ, D, generator=gen).to(DEVICE)
    args = (q, k, v, _int32([3, 4]), _int32([[-1], [-1]]), 0.125)
    with pytest.raises(ValueError, match="base must be"):
        row_attention(*args, _int32([0]))
    with pytest.raises(ValueError, match="base must be int32"):
        row_attention(*args, _int32([0, 1]).long())
    # prefix keys past the cache's end are not read (the row sees the keys that exist)
    out = row_attention(*args, _int32([0, 14]))
    alone = row_attention(q[1:], k[:, 14:], v[:, 14:], _int32([2]), _int32([[-1]]), 0.125)
    assert torch.equal(out[1], alone[0])


# ---- through the engine ---------------------------------------------------------------------


def _triton_engine(model, width=8, capacity=400, executor="eager"):
    """A fixed-layout engine whose attention is the Triton kernel (the CUDA backend; on the
    CPU under the interpreter)."""
    engine = Engine(model, EngineConfig(width=width, capacity=capacity, row_layout="fixed",
                                        executor=executor, measurement_cache=False))
    engine.attention = TritonAttention()
    return engine


NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tree_setup():
    """A 2-layer model, random top-layer heads, a prompt and the Triton engine's AR output."""
    model = tiny_model("llama", seed=0, layers=2).to(DEVICE)
    p = prompt(0, 17, 256)
    return model, random_top_heads(model, depth=3), p, _triton_engine(model).generate_ar(p, NEW_TOKENS)


def _tree_decoder(engine, top):
    config = DecodeConfig(thresholds=0.0, lookup="first", tree="on", siblings=3, sibling_min_prob=0.0,
                          adaptive=False)
    return SelfSpecDecoder(engine, top, config)


def test_tree_decoding_on_the_triton_path_equals_engine_ar(tree_setup, monkeypatch):
    """Top-layer heads' trees with siblings on the Triton attention: output == the engine's
    AR output, and a row off the chain was accepted (the tree path was really used). Then
    the same through the CUDA-graph runner (stand-in graphs on the CPU): paths go through
    its static device buffer (one program per key serves chains and trees), so the logits
    of every new token and the KV left behind (an AR step after the tree steps shows both)
    are the eager engine's bit for bit."""
    monkeypatch.setattr(runner_module, "_require_cuda", lambda engine: None)
    monkeypatch.setattr(CudaGraphRunner, "_record", lambda self, body: ((g := _EagerGraph(body)), g.outputs))
    model, top, p, reference = tree_setup
    results = []
    for graphs in (False, True):
        engine = _triton_engine(model)
        runner = CudaGraphRunner(engine) if graphs else None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            if runner is not None:
                runner.attach()
            result = _tree_decoder(engine, top).generate(p, NEW_TOKENS, collect_logits=True)
            after = engine.ar_step(reference[-1], len(p) + NEW_TOKENS - 1)
        results.append((result, after))
    (eager, eager_after), (graph, graph_after) = results
    assert eager.tokens == reference and eager.stats.off_chain_cycles > 0
    assert graph.tokens == reference
    assert all(torch.equal(a, b) for a, b in zip(graph.logits, eager.logits))
    assert torch.equal(graph_after[0], eager_after[0])
    assert not runner.eager and ("verify", 0) in runner.captured and ("ar",) in runner.captured


def test_select_attention_takes_batches_where_the_layout_does():
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    assert not select_attention(cuda, FixedLayout(8)).supports_batches  # every product on 8 rows
    wide = FixedLayout(8)
    wide.rows = lambda n: max(n, 8)  # a layout that computes every row of a wide step
    attention = select_attention(cuda, wide)
    assert isinstance(attention, TritonAttention) and attention.supports_trees and attention.supports_batches


def test_batched_step_on_the_triton_path_equals_each_sequence_alone():
    """Two sequences' rows in one engine step (each in its own KV region): every row's
    logits bit-identical to its sequence's step alone at slot 0."""
    model = tiny_model("llama", seed=1, layers=2).to(DEVICE)
    engine = _triton_engine(model, width=8, capacity=300)  # 6 rows: within the fixed width
    prompts = [prompt(1, 40, 256), prompt(2, 9, 256)]
    alone = []
    for p in prompts:
        engine.prefill(p)
        meta = engine.rows_meta(engine.step_rows(range(len(p), len(p) + 3)))
        logits, _, _ = engine.verify(engine.embed([5, 6, 7]), 0, meta)
        alone.append(logits)
    bases = [0, 150]
    parts = []
    for p, b in zip(prompts, bases):
        engine.prefill(p, base=b)
        n = len(p)
        parts.append(StepRows(list(range(n, n + 3)), [b + i for i in range(n, n + 3)],
                              list(range(n, n + 3)), None, [b] * 3))
    meta = engine.rows_meta(StepRows.concat(parts))
    logits, _, _ = engine.verify(engine.embed([5, 6, 7] * 2), 0, meta)
    assert torch.equal(logits[:3], alone[0]) and torch.equal(logits[3:], alone[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tree_decoding_through_real_cuda_graphs_equals_engine_ar(dtype):
    """On CUDA: an engine built with the graph executor decodes trees (top heads with
    siblings) with the output of the eager engine's AR, logits bit for bit the eager tree
    decoding's, and no capture fell back."""
    model = tiny_model("llama", seed=0, layers=2).to("cuda", dtype)
    top = random_top_heads(model, depth=3)
    p = prompt(0, 17, 256)
    eager = Engine(model, EngineConfig(width=8, capacity=400, row_layout="fixed"))
    graphs = Engine(model, EngineConfig(width=8, capacity=400, row_layout="fixed", executor="cuda_graphs"))
    assert graphs.supports_trees and graphs.graphs is not None
    reference = eager.generate_ar(p, 24)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = _tree_decoder(graphs, top).generate(p, 24, collect_logits=True)
    theirs = _tree_decoder(eager, top).generate(p, 24, collect_logits=True)
    assert ours.tokens == theirs.tokens == reference and ours.stats.off_chain_cycles > 0
    assert all(torch.equal(a, b) for a, b in zip(ours.logits, theirs.logits))
    assert not graphs.graphs.eager
