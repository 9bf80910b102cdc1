"""Engine AR == HF greedy; the row invariant bit for bit in every layout and dtype; the
layout registry and its self-tests; bad input; an acyclic engine package."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import engine_or_skip, hf_greedy, tiny_model

from hf_selfspec.engine import costs
from hf_selfspec.engine.core import Engine, EngineConfig
from hf_selfspec.engine.layered import UnsupportedModelError
from hf_selfspec.engine.layouts import LAYOUTS, rows_invariant

KEPT = ["fixed", "micro", "kernel"]


@pytest.fixture(autouse=True)
def _measurement_cache(tmp_path, monkeypatch):
    """Each test measures for itself: a fresh, empty measurement cache (engine/cache.py)."""
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "selfspec_cache"))


@pytest.mark.parametrize("layout,prefill", [("fixed", "engine"), ("micro", "hf"), ("micro", "engine"), ("kernel", "hf"),
                                            ("kernel", "engine")])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("kv_heads", [2, 4])  # GQA and MHA
@pytest.mark.parametrize("seed", [0, 1])
def test_engine_ar_matches_hf_greedy(kind, kv_heads, seed, layout, prefill):
    model = tiny_model(kind, seed=seed, kv_heads=kv_heads)
    engine = engine_or_skip(model, EngineConfig(width=8, capacity=512, row_layout=layout, prefill=prefill))
    gen = torch.Generator().manual_seed(100 + seed)
    for prompt_len in (1, 5, 8, 9, 77, 300):  # chunk edges and a second key block
        prompt = torch.randint(3, 256, (prompt_len,), generator=gen).tolist()
        assert engine.generate_ar(prompt, 24) == hf_greedy(model, prompt, 24), prompt_len


@pytest.mark.parametrize("layout,prefill", [("fixed", "engine"), ("micro", "engine"), ("kernel", "hf"),
                                            ("kernel", "engine")])
@pytest.mark.parametrize("kind", ["smollm3", "phi3", "phi3_partial", "granite", "olmo2", "gemma", "gemma2", "gemma3",
                                  "olmo3", "lfm2", "qwen3_5", "granite4h", "deepseek_v3"])
def test_engine_ar_matches_hf_greedy_on_llama_variants(kind, layout, prefill):
    """SmolLM3 leaves layers 1 and 3 here unrotated (no_rope_layers; the C++ layers run in
    one call per run of layers with or without RoPE); Phi-3 fuses q/k/v and gate/up into
    one weight each (read as row ranges of it), phi3_partial rotates half of each head's
    dimensions; Granite scales the embedding rows, the
    attention scores, each block's output and the logits; LFM2 convolves in alternate layers,
    Qwen 3.5 runs gated DeltaNets there, Granite 4.0-H Mamba2 mixers (and rotates none);
    DeepSeek-V3 makes each head's keys and values from latents (HF's prefill caches those)."""
    model = tiny_model(kind, seed=4)
    engine = engine_or_skip(model, EngineConfig(width=8, capacity=512, row_layout=layout, prefill=prefill))
    # SmolLM3's layers 1 and 3 unrotated; LFM2's and Qwen 3.5's layers 0 and 2 have no attention
    unrotated = {"smollm3": (1, 3), "lfm2": (0, 2), "qwen3_5": (0, 2), "granite4h": (0, 1, 2, 3)}.get(kind, ())
    assert engine.view.rope_layers == tuple(i not in unrotated for i in range(4))
    gen = torch.Generator().manual_seed(104)
    for prompt_len in (1, 9, 77, 300):
        prompt = torch.randint(3, 256, (prompt_len,), generator=gen).tolist()
        assert engine.generate_ar(prompt, 24) == hf_greedy(model, prompt, 24), prompt_len


@pytest.mark.parametrize("layout", KEPT)
@pytest.mark.parametrize("kind", ["qwen2", "llama_bias"])
def test_engine_ar_matches_hf_greedy_with_linear_biases(kind, layout):
    """Layouts that compute the product themselves must add the layer's bias."""
    model = tiny_model(kind, seed=2)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    engine = engine_or_skip(model, EngineConfig(width=8, capacity=512, row_layout=layout))
    gen = torch.Generator().manual_seed(7)
    for prompt_len in (1, 9, 77):
        prompt = torch.randint(3, 256, (prompt_len,), generator=gen).tolist()
        assert engine.generate_ar(prompt, 24) == hf_greedy(model, prompt, 24), prompt_len


def test_engine_ar_stops_at_eos():
    model = tiny_model("llama", seed=3)
    engine = Engine(model, EngineConfig(width=4, capacity=256))
    prompt = list(range(3, 20))
    free = engine.generate_ar(prompt, 30)
    eos = free[5]
    stopped = engine.generate_ar(prompt, 30, eos_token_ids=[eos])
    assert stopped == free[: free.index(eos) + 1]
    assert stopped == hf_greedy(model, prompt, 30, eos_token_id=eos)


def _block_rows(engine, tokens, positions):
    meta = engine.make_meta(positions)
    return engine.embed(tokens), meta


# every layout in every dtype it serves (the C++ kernel reads bf16/fp16 weights as stored)
LAYOUT_DTYPES = [(name, dtype) for name in KEPT for dtype in (torch.float32, torch.bfloat16)] + [
    ("fixed", torch.float16), ("kernel", torch.float16)]


@pytest.mark.parametrize("layout,dtype", LAYOUT_DTYPES)
@pytest.mark.parametrize("kind", ["llama", "qwen3", "smollm3", "phi3_partial", "granite", "olmo2", "gemma2", "gemma3"])
def test_rows_are_invariant_to_the_other_rows(kind, layout, dtype):
    """Row i of a step with n real rows == the same row computed alone (same width), for
    seg and verify: hidden states and logits bit for bit, in every dtype a layout serves."""
    model = tiny_model(kind, seed=5).to(dtype)
    width = 8
    engine = engine_or_skip(model, EngineConfig(width=width, capacity=600, row_layout=layout))
    assert engine.layout.name == layout
    prompt = torch.randint(3, 256, (290,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.prefill(prompt)
    start = len(prompt)
    block = torch.randint(3, 256, (width,), generator=torch.Generator().manual_seed(1)).tolist()

    # all rows together: seg over layers [0, 2), then verify from layer 2
    h, meta = _block_rows(engine, block, range(start, start + width))
    h_seg = engine.seg(h, 0, 2, meta)
    logits_all, _, _ = engine.verify(h_seg.clone(), 2, meta)
    assert h_seg.dtype == dtype

    # row i alone: the rows before it must already be in the KV cache (they are: the
    # joint step wrote them with identical values), so run row i as a 1-row step
    for i in range(width):
        h1, meta1 = _block_rows(engine, [block[i]], [start + i])
        h1_seg = engine.seg(h1, 0, 2, meta1)
        assert torch.equal(h1_seg[0], h_seg[i]), f"seg row {i}"
        logits1, _, _ = engine.verify(h1_seg, 2, meta1)
        assert torch.equal(logits1[0], logits_all[i]), f"verify row {i}"


def test_row_self_test_rejects_a_product_that_depends_on_the_other_rows():
    """The start-up self-test behind micro and kernel can fail: a product whose row depends
    on how many rows share it (here: shifted by a neighbour-dependent amount) is refused, a
    product computed one row at a time (row-invariant on any BLAS) passes. (A plain 2-row
    product is machine-dependent: row-invariant with the AMD EPYC's MKL, not with an
    AVX-512 Xeon's, where the engine refuses micro and `auto` picks another layout.)"""
    layers = [torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 64, bias=False)]

    def one_row_at_a_time(layer, x):
        return torch.cat([layer(x[i:i + 1]) for i in range(len(x))])

    assert rows_invariant(layers, one_row_at_a_time, ref_rows=2)
    assert rows_invariant(layers, one_row_at_a_time, ref_rows=1, sizes=(2, 3, 4, 8))

    def leaky(layer, x):
        return one_row_at_a_time(layer, x) + 1e-3 * x.sum(0, keepdim=True)[:, :1]

    assert not rows_invariant(layers, leaky, ref_rows=2)
    assert not rows_invariant(layers, leaky, ref_rows=4, sizes=(4, 8))
    assert LAYOUTS["fixed"].self_test(layers)


def test_layout_registry_names_and_removed_layouts():
    """The registry holds the kept layouts; a removed or unknown name is refused where the
    config is made, naming the layouts that exist."""
    assert set(LAYOUTS) == set(KEPT)
    for name in ("gemv", "wx", "wx4", "blas"):
        with pytest.raises(ValueError, match="row_layout must be one of .*'kernel', 'micro', 'fixed'"):
            EngineConfig(row_layout=name)
    with pytest.raises(ValueError, match="engine_layouts_history"):
        EngineConfig(row_layout="wx4")


@pytest.mark.parametrize("failing", [("micro",), ("kernel",), ("kernel", "micro")])
def test_auto_layout_when_some_self_tests_fail(monkeypatch, failing):
    """`auto` takes only layouts whose self-test passed on this machine, also when the
    first one (the tie-break reference) failed: found on an AVX-512 Xeon where micro failed
    on a 64-wide model and `auto` raised KeyError. The result is still exact."""
    for name in failing:
        monkeypatch.setattr(LAYOUTS[name], "self_test", classmethod(lambda cls, linears: False))
    model = tiny_model("llama", seed=4)
    engine = Engine(model, EngineConfig(width=8, capacity=256))
    assert engine.layout.name not in failing
    prompt = list(range(3, 40))
    assert engine.generate_ar(prompt, 12) == hf_greedy(model, prompt, 12)


def test_auto_layout_prefers_the_kernel_at_equal_product_cost(monkeypatch):
    """At equal product (GEMM) time `auto` takes the C++ kernel layout, whose fused layers
    and row attention make the whole step cheaper (found on an AVX-512 Xeon: micro was
    picked at slightly dearer products and its AR step was much slower)."""
    from hf_selfspec.kernels.cpu_rows import load_rows_linear

    if load_rows_linear() is None:
        pytest.skip("the C++ row kernel cannot be built on this machine")
    monkeypatch.setattr(costs, "gemm_seconds", lambda layout, linears, width, reps=3, give_up=None, per_rows=None: 1.0)
    assert Engine(tiny_model("llama", seed=4), EngineConfig(width=8, capacity=256)).layout.name == "kernel"


def fake_products(monkeypatch, seconds: dict[str, float]) -> list[tuple[str, float]]:
    """costs.gemm_seconds replaced: each layout's products take `seconds[name]` (inf past
    the give-up time); returns the list of (layout, give_up) it is called with."""
    calls = []

    def fake(layout, linears, width, reps=3, give_up=float("inf"), per_rows=None):
        calls.append((layout.name, give_up))
        return float("inf") if seconds[layout.name] > give_up else seconds[layout.name]

    monkeypatch.setattr(costs, "gemm_seconds", fake)
    return calls


@pytest.mark.parametrize("micro_seconds,chosen", [(0.5, "micro"), (0.95, "kernel")])
def test_auto_layout_gives_up_timing_a_candidate_that_has_lost(monkeypatch, micro_seconds, chosen):
    """The first passing layout (kernel) is timed in full; the next one only until it can no
    longer win (SWITCH_MARGIN of the first's cost), so a big model's first call does not
    wait for a loser's whole pass over its weights."""
    from hf_selfspec.kernels.cpu_rows import load_rows_linear

    from hf_selfspec.engine.layouts import SWITCH_MARGIN

    if load_rows_linear() is None:
        pytest.skip("the C++ row kernel cannot be built on this machine")
    calls = fake_products(monkeypatch, {"kernel": 1.0, "micro": micro_seconds})
    tested = []  # a candidate is self-tested only once its products could win
    real_test = LAYOUTS["micro"].self_test.__func__
    monkeypatch.setattr(LAYOUTS["micro"], "self_test",
                        classmethod(lambda cls, linears: tested.append(1) or real_test(cls, linears)))
    engine = Engine(tiny_model("llama", seed=4), EngineConfig(width=8, capacity=256, measurement_cache=False))
    assert engine.layout.name == chosen
    assert calls == [("kernel", float("inf")), ("micro", SWITCH_MARGIN * 1.0)]
    assert len(tested) == (chosen == "micro")


@pytest.mark.parametrize("fixed_seconds,chosen", [(0.5, "fixed"), (0.95, "micro")])
def test_without_the_kernel_auto_times_micro_against_fixed(monkeypatch, fixed_seconds, chosen):
    """Where the kernel cannot run, `auto` picks the cheaper BLAS layout: micro (2-3 row
    chunks) is the reference, fixed (always W rows; MKL on an AMD EPYC runs 8 rows cheaper
    than 2-3) replaces it when its products are SWITCH_MARGIN cheaper. Still exact."""
    from hf_selfspec.engine.layouts import SWITCH_MARGIN

    monkeypatch.setattr(LAYOUTS["kernel"], "self_test", classmethod(lambda cls, linears: False))
    calls = fake_products(monkeypatch, {"micro": 1.0, "fixed": fixed_seconds})
    model = tiny_model("llama", seed=4)
    engine = Engine(model, EngineConfig(width=8, capacity=256, measurement_cache=False))
    assert engine.layout.name == chosen
    assert calls == [("micro", float("inf")), ("fixed", SWITCH_MARGIN * 1.0)]
    prompt = list(range(3, 40))
    assert engine.generate_ar(prompt, 12) == hf_greedy(model, prompt, 12)


def test_gemm_seconds_stops_past_its_give_up_time():
    model = tiny_model("llama")
    layout = LAYOUTS["micro"](8)  # F.linear: runs on any machine
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert costs.gemm_seconds(layout, linears, 8, give_up=0.0) == float("inf")
    assert 0.0 < costs.gemm_seconds(layout, linears, 8) < float("inf")


def test_over_capacity_prompt_is_refused_before_work():
    model = tiny_model("llama")
    engine = Engine(model, EngineConfig(width=8, capacity=64))
    with pytest.raises(ValueError, match="exceeds the engine's KV capacity"):
        engine.generate_ar(list(range(3, 53)), max_new_tokens=10)
    assert engine.k_cache.abs().sum() == 0  # nothing was computed


def test_empty_prompt_is_refused():
    engine = Engine(tiny_model("llama"), EngineConfig(width=8, capacity=64))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate_ar([], max_new_tokens=4)


def test_unsupported_architecture_names_it():
    from transformers import RwkvConfig, RwkvForCausalLM

    model = RwkvForCausalLM(RwkvConfig(num_hidden_layers=2, hidden_size=32, vocab_size=64, attention_hidden_size=32,
                                       intermediate_size=64))  # RWKV: not served
    with pytest.raises(UnsupportedModelError, match="rwkv"):
        Engine(model)


def test_bad_engine_config():
    with pytest.raises(ValueError, match="width"):
        EngineConfig(width=0)
    with pytest.raises(ValueError, match="capacity"):
        EngineConfig(width=8, capacity=4)


@pytest.mark.parametrize("layout", ["micro", "kernel"])
def test_step_costs_are_per_program_and_monotone(layout):
    """The draft budget's cost curve: one figure per width, 1.0 for one row, never falling
    with more rows, and equal for widths that run the same programs (micro: 1 and 2 rows
    are one 2-row step with one attention chunk). Measuring it leaves decoding exact."""
    model = tiny_model("llama", seed=4)
    engine = engine_or_skip(model, EngineConfig(width=8, capacity=512, row_layout=layout))
    prompt = list(range(3, 60))
    before = engine.generate_ar(prompt, 12)
    costs_ = engine.costs.step_costs()
    assert len(costs_) == engine.width + 1 and costs_[0] == costs_[1] == 1.0
    assert all(b >= a for a, b in itertools.pairwise(costs_[1:]))
    if layout == "micro":
        assert costs_[1] == costs_[2]
    assert engine.costs.one_row_seconds() > 0
    assert engine.generate_ar(prompt, 12) == before


def test_kernel_layout_refuses_dtypes_it_does_not_read():
    """The C++ row kernel reads fp32/bf16/fp16 weights as stored: asked for on a float64
    model it is refused with a clear error before any work, and `auto` picks another layout."""
    model = tiny_model("llama", seed=6).to(torch.float64)
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        Engine(model, EngineConfig(width=8, capacity=256, row_layout="kernel"))
    assert Engine(model, EngineConfig(width=8, capacity=256)).layout.name != "kernel"


@pytest.mark.parametrize("layout,dtype", LAYOUT_DTYPES)
def test_rows_do_not_depend_on_where_segs_split_the_layers(layout, dtype):
    """AR runs all layers in one go, a chain in several segs: a row's logits must not depend
    on the split (bf16/fp16: the residual stream rounds at every layer boundary)."""
    model = tiny_model("qwen3", seed=9).to(dtype)
    engine = engine_or_skip(model, EngineConfig(width=8, capacity=400, row_layout=layout))
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    engine.prefill(prompt)
    block, positions = [5, 17, 99], range(len(prompt), len(prompt) + 3)
    h, meta = _block_rows(engine, block, positions)
    whole, _, _ = engine.verify(h, 0, meta)
    for splits in ([1], [2], [1, 3]):
        h, meta = _block_rows(engine, block, positions)
        start = 0
        for end in splits:
            h = engine.seg(h, start, end, meta)
            start = end
        logits, _, _ = engine.verify(h, start, meta)
        assert torch.equal(logits, whole), splits


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2", "smollm3", "phi3", "phi3_partial", "granite", "olmo2",
                                  "gemma", "gemma2", "gemma3", "olmo3"])
def test_kernel_layout_fused_layers_match_the_pytorch_layer(kind):
    """The kernel layout runs a step's decoder layers in one C++ call (rows_layers), Qwen2's
    q/k/v biases included: its hidden states, KV and logits agree with the same engine
    running the PyTorch layer ops to fp32 rounding, on every row of a step."""
    model = tiny_model(kind, seed=8)
    engine = Engine(model, EngineConfig(width=8, capacity=600, row_layout="kernel"))
    assert engine._fused_weights is not None
    assert (engine._fused_per_layer == 20) == (kind == "qwen2")  # the form with biases
    fused = engine._fused_weights
    prompt = torch.randint(3, 256, (290,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.prefill(prompt)
    block = list(range(10, 16))
    results = []
    for layers in (fused, None):
        engine._fused_weights = layers
        meta = engine.make_meta(range(len(prompt), len(prompt) + len(block)))
        h = engine.seg(engine.embed(block), 0, 2, meta)
        logits, _, _ = engine.verify(h.clone(), 2, meta)
        kv = engine.k_cache[:, :, len(prompt):len(prompt) + len(block)].clone()
        results.append((h, logits, kv))
    engine._fused_weights = fused
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_engine_package_imports_form_no_cycle():
    """No module of hf_selfspec/engine imports, at import time, one that imports it back
    (annotation-only imports under TYPE_CHECKING and imports inside functions excluded)."""
    import ast
    from pathlib import Path

    import hf_selfspec.engine as package

    folder = Path(package.__file__).parent
    graph = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        deps = set()
        for node in tree.body:  # module level only
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hf_selfspec.engine."):
                deps.add(node.module.rsplit(".", 1)[1])
        graph[path.stem] = deps & {p.stem for p in folder.glob("*.py")}
    assert "core" not in graph["cuda_graphs"] and "cuda_graphs" not in graph["core"]

    def visit(node, stack):
        assert node not in stack, f"import cycle: {' -> '.join([*stack, node])}"
        for dep in graph[node]:
            visit(dep, [*stack, node])

    for module in graph:
        visit(module, [])


def test_the_engines_users_import_its_interface_not_its_module():
    """Decoding, the attention backends, the CUDA-graph executor, the cost model, the
    mixers and the KV regions annotate against interface.py's protocols: none of them
    imports the engine's module (core.py, nor its parts), not even for annotations."""
    import ast
    from pathlib import Path

    import hf_selfspec

    root = Path(hf_selfspec.__file__).parent
    engine_parts = {"core", "kv_cache", "metadata", "execution", "prefill", "programs"}
    users = [*sorted((root / "decoding").glob("*.py"))] + [
        root / "engine" / f"{name}.py" for name in ("attention", "costs", "cuda_graphs", "mixers", "regions")]
    for path in users:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = (node.module or "").rsplit(".", 1)[-1]
                names = {alias.name for alias in node.names}
                assert module not in engine_parts and not names & engine_parts, (path.name, ast.unparse(node))


def test_engine_and_kv_region_implement_the_protocols():
    """Engine implements every protocol of interface.py; KVRegion implements
    SequenceEngine explicitly, every member its own (none falls back to the protocol's
    empty body); the costs are measured by explicit calls on `engine.costs`."""
    import inspect

    from hf_selfspec.engine import interface
    from hf_selfspec.engine.regions import KVRegion, plan_regions

    model = tiny_model("llama", seed=0, layers=2)
    engine = engine_or_skip(model, EngineConfig(width=4, capacity=256, row_layout="kernel",
                                                measurement_cache=False))
    for protocol in (interface.SequenceEngine, interface.BatchEngine, interface.StepPrograms):
        assert isinstance(engine, protocol), protocol.__name__
    for protocol in (interface.AttentionHost, interface.MeasuredEngine, interface.GraphHost, interface.MixerHost):
        members = [name for klass in protocol.__mro__ if klass.__module__ == interface.__name__
                   for name in (*vars(klass), *getattr(klass, "__annotations__", {}))
                   if not name.startswith("_")]
        assert all(hasattr(engine, name) for name in members), protocol.__name__
    assert isinstance(engine.costs, interface.StepCosts)
    assert not engine.costs.has_step_costs  # nothing measured by building or reading attributes
    protocol_members = [name for name in vars(interface.SequenceEngine) if not name.startswith("_")]
    assert protocol_members and all(name in vars(KVRegion) for name in protocol_members)
    assert set(protocol_members) <= {name for name, _ in inspect.getmembers(KVRegion)}
    region, = plan_regions(engine, [64])
    assert isinstance(region, interface.SequenceEngine) and region.costs is engine.costs
    assert region.head_device == engine.head_device


def test_contention_watch_switches_to_the_work_pool_after_slow_steps():
    """Steps several times slower than measured, three in a row, turn on the kernels'
    work-sharing pool once (other processes busy on the cores); a normal step in between
    resets the count; the tokens are the same either way."""
    from hf_selfspec.kernels.cpu_rows import use_work_pool

    watch = costs.ContentionWatch()
    slow = costs.CONTENDED_FACTOR * 1.5
    assert not any(watch.observe(1.0, s) for s in (slow, slow, 1.0, slow, slow))
    assert not watch.observe(None, slow)  # nothing measured: nothing to compare with
    model = tiny_model("llama", seed=0, layers=2)
    engine = engine_or_skip(model, EngineConfig(width=4, capacity=64, row_layout="kernel"))
    prompt = [5, 9, 17, 33, 5, 9]
    before = engine.generate_ar(prompt, 12)
    engine.costs.step_costs()  # (measured)
    previous = use_work_pool(False)
    try:
        expected = engine.costs.one_row_seconds() * engine.costs.step_costs()[2]
        for _ in range(costs.SLOW_STEPS_IN_A_ROW - 1):
            engine.costs.observe_step(2, expected * slow)
        assert use_work_pool() is False
        engine.costs.observe_step(2, expected * slow)
        assert use_work_pool() is True and engine.costs.contention.switched
        assert engine.generate_ar(prompt, 12) == before
    finally:
        use_work_pool(previous)


def test_step_costs_at_a_longer_context_weigh_each_rows_attention():
    """A step of n rows at `extra` more keys costs its measured cost plus n rows' attention
    over them: relative to one row, more rows cost more at a long context; none changes
    at the measured context; the engine's own curve and attention cost are measured."""
    curve = (1.0, 1.0, 1.1, 1.2)
    assert costs.costs_at(curve, 0.02, 1e-6, 0) == curve
    longer = costs.costs_at(curve, 0.02, 1e-6, 1000)
    assert longer[:2] == (1.0, 1.0)
    assert longer[2] == pytest.approx((1.1 * 0.02 + 2e-3) / 0.021)
    assert longer[3] == pytest.approx((1.2 * 0.02 + 3e-3) / 0.021) and longer[3] > curve[3]
    shorter = costs.costs_at(curve, 0.02, 1e-6, -1000)  # 1 ms less per row
    assert shorter[2] == pytest.approx((1.1 * 0.02 - 2e-3) / 0.019) and shorter[2] < curve[2]
    assert shorter[3] == pytest.approx((1.2 * 0.02 - 3e-3) / 0.019) and shorter[3] < curve[3]
    flat = costs.costs_at((1.0, 1.0, 1.0, 1.2), 0.02, 1e-6, -1000)
    assert flat[:3] == (1.0, 1.0, 1.0)  # (0.02 - 2e-3) / 0.019 < 1: never below fewer rows
    assert costs.costs_at(curve, 0.02, 1e-6, -10 ** 6)[1] == 1.0  # at most half a step saved
    model = tiny_model("llama", seed=0, layers=2)
    engine = engine_or_skip(model, EngineConfig(width=4, capacity=2048, row_layout="kernel",
                                                measurement_cache=False))
    verify = engine.verify
    engine.verify = None  # the attention cost is timed on the attention alone, not whole steps
    assert engine.costs.attention_seconds() > 0  # a 4x longer context measurably costs more
    engine.verify = verify
    far = engine.costs.step_costs_at(2000)
    assert far[4] >= engine.costs.step_costs()[4]
    near = engine.costs.step_costs_at(10)  # a tiny model: steps timed cheaply, short contexts weighed
    assert engine.costs.times_steps_cheaply() and near[4] <= engine.costs.step_costs()[4]
    measured = engine.costs
    assert near == costs.costs_at(measured.step_costs(), measured.one_row_seconds(), measured.attention_seconds(),
                                  10 - costs.cost_context(engine))


def test_step_costs_of_a_big_model_come_from_the_layout_choices_product_timings(monkeypatch):
    """Where a round of step timing would take over ESTIMATE_ABOVE_SECONDS (every 1..W-row
    step of a model of gigabytes streams all its weights), the curve is the products' of 1
    and W rows that choosing the layout has just timed, linear in between, and no step is
    timed; below it, or with products unknown (a cached layout), the steps are timed."""
    assert costs.step_costs_from_products(8, {1: 0.02, 8: 0.03}) is None  # a small model: timed
    # a 0.49B bf16 model's products (timing its steps took 2 s of its first call): estimated
    assert costs.step_costs_from_products(8, {1: 0.036, 8: 0.054}) is not None
    assert costs.step_costs_from_products(8, {}) is None
    curve, one = costs.step_costs_from_products(8, {1: 0.12, 8: 0.19})
    assert one == 0.12 and len(curve) == 9 and curve[:2] == (1.0, 1.0)
    assert curve[8] == pytest.approx(0.19 / 0.12) and curve[4] == pytest.approx(1 + (0.19 / 0.12 - 1) * 3 / 7)
    assert costs.step_costs_from_products(4, {1: 0.2, 4: 0.1})[0] == (1.0,) * 5  # never cheaper with rows

    def big_products(layout, linears, width, reps=3, give_up=float("inf"), per_rows=None):
        per_rows.update({1: 0.12, width: 0.19})
        return 0.31 if layout.name == "micro" else 0.3

    def refuse(engine):
        raise AssertionError("steps timed")

    monkeypatch.setattr(costs, "gemm_seconds", big_products)
    monkeypatch.setattr(costs, "measure_step_costs", refuse)
    engine = engine_or_skip(tiny_model("llama", seed=4), EngineConfig(width=8, capacity=256,
                                                                      measurement_cache=False))
    assert engine.costs.step_costs()[8] == pytest.approx(0.19 / 0.12)
    assert engine.costs.one_row_seconds() == 0.12


def test_a_request_within_the_measured_context_does_not_time_the_attention(monkeypatch):
    """On a model whose step timing is not cheap (a model of gigabytes),
    generate(assistant="self") measures the attention cost per row and key only for a
    request whose rows see more keys than the step costs were measured at, and a short
    request plans with the measured curve as is."""
    from hf_selfspec import attach_heads
    monkeypatch.setattr(costs.EngineCosts, "times_steps_cheaply", lambda self: False)

    calls = []
    real = costs.measure_attention_seconds
    monkeypatch.setattr(costs, "measure_attention_seconds", lambda engine: calls.append(1) or real(engine))
    model = tiny_model("llama", seed=0, layers=2)
    attach_heads(model, heads=False, engine=EngineConfig(width=4, capacity=2048, measurement_cache=False))
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(0))
    model.generate(ids, assistant="self", max_new_tokens=8, do_sample=False)
    assert calls == []
    engine = model._selfspec.engine
    assert engine.costs.step_costs_at(20) == engine.costs.step_costs()
    long_ids = torch.randint(3, 200, (1, costs.cost_context(engine) + 10), generator=torch.Generator().manual_seed(1))
    model.generate(long_ids, assistant="self", max_new_tokens=8, do_sample=False)
    assert calls == [1]


def test_step_costs_average_out_a_noisy_width():
    """A width measured dear by noise is pooled with the cheaper widths after it (least-squares
    non-decreasing fit), not carried into every wider step; nothing costs less than 1 row."""
    from hf_selfspec.engine.costs import non_decreasing, relative_costs

    assert non_decreasing([1.0, 1.06, 1.14, 1.356, 1.31, 1.38]) == pytest.approx([1.0, 1.06, 1.14, 1.333, 1.333, 1.38])
    assert non_decreasing([3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert relative_costs([10.0, 9.0, 12.0, 11.0]) == pytest.approx([1.0, 1.0, 1.15, 1.15])
