"""Recorded decode traces (scripts/record_traces.py) and their replay (scripts/gpu_check.py
--replay-only), on the CPU: a tiny model's trace is recorded through the decoder's trace
hook, then replayed by the GPU check's own code with DEVICE swapped to the CPU, the Triton
attention under the interpreter and stand-in graphs. The replay must verify exactly the
recorded rows, cycle by cycle, and count exactly the recorded committed tokens.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

pytest.importorskip("triton", reason="triton is not installed: the Triton kernel cannot run")
# on a GPU machine scripts/gpu_check.sh runs the real replay (graphs, CUDA tensors)
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run of the replay")

from conftest import tiny_model
from test_decoding import prompt
from test_gpu import _EagerGraph

import hf_selfspec.engine.cuda_graphs as runner_module
from hf_selfspec.decoding.cycle import DecodeConfig, SelfSpecDecoder
from hf_selfspec.engine.attention import TritonAttention
from hf_selfspec.engine.core import Engine, EngineConfig
from hf_selfspec.engine.cuda_graphs import CudaGraphRunner
from hf_selfspec.heads.top import random_top_heads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import gpu_check
import record_traces

NEW_TOKENS = 8
TINY = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256, "vocab": 256, "tie": False}


def _triton_engine(model, width=8, capacity=400, executor="eager"):
    engine = Engine(model, EngineConfig(width=width, capacity=capacity, row_layout="fixed",
                                        executor=executor, measurement_cache=False))
    engine.attention = TritonAttention()
    return engine


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A tiny model's trace (two prompts, trees with siblings) written as record_traces does,
    the tokens decoded with the trace hook on, and the engine's AR tokens."""
    model = tiny_model("llama", seed=0, layers=2)
    top = random_top_heads(model, depth=3)
    engine = _triton_engine(model)
    config = DecodeConfig(thresholds=0.0, lookup="first", tree="on", siblings=3, sibling_min_prob=0.0,
                          adaptive=False)
    prompts = [prompt(0, 17, 256), prompt(1, 30, 256)]
    events, traced = [], []
    for p in prompts:
        decoder = SelfSpecDecoder(engine, top, config)
        decoder.trace = events
        traced.append(decoder.generate(p, NEW_TOKENS).tokens)
    cycles = record_traces.cycles_from_events(events)
    for entry, out in zip(cycles, traced):
        entry.update(category="test", new_tokens=len(out))
    lookup = [record_traces.count_hf_lookup_passes(model, torch.tensor([p]), NEW_TOKENS) for p in prompts]
    data = {"format": record_traces.FORMAT_VERSION, "model": "tiny", "heads": "random top heads",
            "width": engine.width, "max_new_tokens": NEW_TOKENS,
            "decode_config": {"siblings": config.siblings, "tree_beam": config.tree_beam},
            "tree_mode": True, "traces": {"cpu": cycles},
            "hf_prompt_lookup": [{"passes": h["passes"], "rows": h["rows"], "new_tokens": len(h["tokens"])}
                                 for h in lookup]}
    path = tmp_path_factory.mktemp("traces") / "tiny.json.gz"
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    reference = [engine.generate_ar(p, NEW_TOKENS) for p in prompts]
    return path, cycles, traced, reference


def test_trace_hook_records_every_cycle_and_changes_no_token(recorded):
    path, cycles, traced, reference = recorded
    assert traced == reference
    assert [e["prompt_tokens"] for e in cycles] == [17, 30]
    for entry, out in zip(cycles, traced):
        # the first token comes from the prefill; every later one from a recorded cycle
        assert sum(c[2] for c in entry["cycles"]) == len(out) - 1
        for position, n, committed, budget, parents, accepted in entry["cycles"]:
            assert 1 <= n <= 8 and accepted[0] == 0 and len(accepted) >= committed >= 1
            assert parents is None or (len(parents) == n and parents[0] == -1)
    trees = [c for e in cycles for c in e["cycles"] if c[4] is not None]
    assert trees and any(c[3] > 0 for e in cycles for c in e["cycles"])  # heads drafted trees
    positions = [c[0] for c in cycles[0]["cycles"]]
    assert positions[0] == 17 and all(b - a == c[2] for a, b, c in zip(positions, positions[1:],
                                                                         cycles[0]["cycles"]))
    assert record_traces.load_traces(path)["traces"]["cpu"] == cycles


def test_replay_verifies_the_recorded_rows_and_commits_the_recorded_tokens(recorded, monkeypatch, capsys):
    """gpu_check --replay-only on the CPU: every recorded cycle is one engine step of its
    recorded rows (through the stand-in graphs), the committed totals are the trace's, and
    the table has every method."""
    path, cycles, *_ = recorded
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_check, "REPLAY_SHAPES", {"tiny": TINY})
    monkeypatch.setattr(runner_module, "_require_cuda", lambda engine: None)
    monkeypatch.setattr(CudaGraphRunner, "_record", lambda self, body: ((g := _EagerGraph(body)), g.outputs))
    seen, engines = [], []

    def engine_with_graphs(model, width, capacity):
        engine = _triton_engine(model, width, capacity, executor="cuda_graphs")
        verify = engine.verify  # the runner's

        def counting(h, start, meta):
            seen.append(h.shape[0])
            return verify(h, start, meta)

        engine.verify = counting
        engines.append(engine)
        return engine

    monkeypatch.setattr(gpu_check, "replay_engine", engine_with_graphs)
    rc = gpu_check.main(["--replay-only", "--replay-trace", str(path), "--replay-shapes", "tiny",
                         "--replay-hf-new", "3", "--dtype", "fp32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    recorded_rows = [c[1] for e in cycles for c in e["cycles"]]
    first = min(cycles, key=lambda e: e["prompt_tokens"])  # the warm-up replays it once
    assert seen == [c[1] for c in first["cycles"]] + recorded_rows
    graphs = engines[0].graphs
    assert not graphs.eager and ("verify", 0) in graphs.captured
    committed = sum(c[2] for e in cycles for c in e["cycles"])
    cycles_n = len(recorded_rows)
    assert f"tau {committed / cycles_n:.2f}" in out and f"{cycles_n} cycles" in out
    for label in ("self-spec replay, trace 'cpu'", "engine AR", "HF greedy", "HF prompt lookup, 10",
                  "HF assisted", "HF prompt lookup on the real model"):
        assert label in out, (label, out)
    assert "OK: every trace replayed" in out


def test_replay_refuses_a_trace_wider_than_the_engine():
    model = tiny_model("llama", seed=0, layers=2)
    engine = _triton_engine(model, width=4, capacity=200)
    entry = {"prompt_tokens": 5, "new_tokens": 3, "cycles": [[5, 6, 2, 0, None, [0, 1]]]}
    with pytest.raises(ValueError, match="does not fit this engine"):
        gpu_check.replay_trace(engine, None, [entry], True, 0, torch)
