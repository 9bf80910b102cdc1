"""What the engine holds and when it is rebuilt: no second copy of the model's weights (every
layout kept), a KV cache sized to the request that grows and shrinks by copying without
measuring again, the measurement cache on disk (untrusted input), stale engines rebuilt
after `.to()` / new tensors, and quantized or wrapped projections refused by name."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from conftest import engine_or_skip, hf_greedy, tiny_model

from hf_selfspec.decoding.cycle import DecodeConfig, SelfSpecDecoder
from hf_selfspec.engine import cache as measurement_cache
from hf_selfspec.engine import costs
from hf_selfspec.engine.core import Engine, EngineConfig
from hf_selfspec.engine.layered import LayeredModel, UnsupportedModelError
from hf_selfspec.integration import SelfSpecState

KEPT = ["fixed", "micro", "kernel"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A fresh measurement cache per test (engine/cache.py)."""
    path = tmp_path / "selfspec_cache"
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(path))
    monkeypatch.delenv("HF_SELFSPEC_NO_CACHE", raising=False)
    return path


def _no_measuring(monkeypatch):
    """From here on, any measurement fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(costs, "gemm_seconds", refuse)
    monkeypatch.setattr(costs, "measure_step_costs", refuse)


# ---- weights: the model's own storage ----------------------------------------------------


def _tensors(obj, seen=None, path="engine"):
    """Every tensor reachable from `obj` through attributes, lists, tuples, dicts and
    dataclasses (not through the HF model itself), as (path, tensor)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, torch.nn.Module) and not isinstance(obj, torch.nn.Linear):
        return []  # the HF model and its submodules: the model's own, not the engine's
    if isinstance(obj, torch.nn.Linear):  # a reference to one of the model's projections
        return [(f"{path}.{name}", p) for name, p in obj.named_parameters()]
    found = []
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__.startswith(
            ("hf_selfspec", "builtins")):
        items = vars(obj).items()
    else:
        return []
    for key, value in items:
        found += _tensors(value, seen, f"{path}.{key}")
    return found


def _model_storages(model):
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


# what the engine owns besides references to the model: KV cache, metadata, RoPE tables,
# and on the kernel layout the int8 copy of a float32 LM head its argmax screen reads, with
# a scale and a bound per row (engine/screen.py: the one copy, a quarter of the LM head),
# and the empty tensor the fused layers get for a norm a layer does not have (OLMo 2);
# LFM2's and Qwen 3.5's convolution inputs and recurrent states of the last few slots (mixer_cache)
OWNED = ("k_cache", "v_cache", "mixer_cache.conv", "mixer_cache.states", "mixer_cache._zero_state", "_meta",
         "_meta_host", "view.cos", "view.sin", "screen.rows.0", "screen.rows.1",
         "screen.rows.2", "screen.rows.3", "_no_norm",
         # the RoPE tables (view.cos / view.sin are the first; Gemma 3 has one per layer type)
         "view.rope_tables.0.0", "view.rope_tables.0.1", "view.rope_tables.1.0", "view.rope_tables.1.1")


def _weights_the_engine_reads(engine):
    return [(path, t) for path, t in _tensors(engine)
            if not any(path == f"engine.{name}" for name in OWNED)
            and not path.startswith("engine._identity_rope.")]  # cos 1 / sin 0 of unrotated layers


@pytest.mark.parametrize("layout", KEPT)
@pytest.mark.parametrize("kind,tie", [("llama", False), ("llama", True), ("phi3", False), ("smollm3", True),
                                      ("olmo2", False), ("gemma2", False), ("gemma3", False), ("lfm2", True),
                                      ("qwen3_5", False), ("granite4h", True), ("deepseek_v3", False)])
def test_every_weight_the_engine_reads_is_the_models_own_storage(layout, kind, tie):
    """Per layout kept: every tensor the engine (its view, layout, attention, fused-layer
    lists) holds, other than its KV cache and small buffers, lives in the storage of one of
    the model's parameters, before and after decoding (a layout that keeps a transposed or
    concatenated copy fails here: see the negative control below; Phi-3's q/k/v and gate/up
    are row ranges of its fused weights)."""
    model = tiny_model(kind, seed=1, tie=tie)
    engine = engine_or_skip(model, EngineConfig(width=8, capacity=256, row_layout=layout))
    storages = _model_storages(model)
    prompt = list(range(3, 40))
    assert engine.generate_ar(prompt, 8) == hf_greedy(model, prompt, 8)
    read = _weights_the_engine_reads(engine)
    assert len(read) >= 9 * 4  # at least every projection and norm of every layer
    for path, t in read:
        assert t.untyped_storage().data_ptr() in storages, f"{path} is not the model's storage"
    # what the engine owns besides: the KV cache and the screen's copy dominate; the rest is small
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    kv = nbytes(engine.k_cache) + nbytes(engine.v_cache)
    if engine.mixer_cache is not None:  # LFM2's and Qwen 3.5's convolution inputs and states of the last slots
        cache = engine.mixer_cache
        kv += nbytes(cache.conv) + (0 if cache.states is None else nbytes(cache.states) + nbytes(cache._zero_state))
    screen = 0 if engine.screen is None else engine.screen.copy_bytes
    # no screen where the logits are transformed (Gemma 2's soft cap: see Engine._make_screen)
    assert (engine.screen is not None) == (layout == "kernel" and not engine.view.logits_transformed)
    assert screen <= 0.3 * nbytes(model.lm_head.weight)
    owned = sum(nbytes(t) for path, t in _tensors(engine) if path in {f"engine.{n}" for n in OWNED})
    assert owned - kv - screen < 0.1 * sum(nbytes(p) for p in model.parameters())


def test_the_storage_check_finds_a_copy():
    """Negative control: a layout holding a transposed copy of a weight (the removed `gemv`
    layout did, for every weight) is caught by the walk above."""
    model = tiny_model("llama", seed=1)
    engine = Engine(model, EngineConfig(width=8, capacity=256, row_layout="fixed"))
    engine.layout.transposed = {0: model.model.layers[0].mlp.up_proj.weight.detach().t().contiguous()}
    storages = _model_storages(model)
    bad = [path for path, t in _weights_the_engine_reads(engine)
           if t.untyped_storage().data_ptr() not in storages]
    assert bad == ["engine.layout.transposed.0"]


# ---- KV cache: sized to the request, grown and shrunk by copying -------------------------


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_fresh_cache_is_zeros_that_take_no_memory_until_written(dtype):
    """The KV cache's buffers (programs.zeroed) hold zeros, start on a cache line, and on
    the CPU take no resident memory before they are written (the OS maps zero pages on
    first touch, as a request's steps write their slots)."""
    from hf_selfspec.engine.core import zeroed

    before = _resident_bytes()
    cache = zeroed((16, 8, 2304, 64), dtype, torch.device("cpu"))  # 151 / 75 MB
    grown = _resident_bytes() - before
    assert cache.shape == (16, 8, 2304, 64) and cache.dtype == dtype and cache.is_contiguous()
    assert cache.data_ptr() % 64 == 0
    assert grown < 16 * 2**20, f"{grown / 2**20:.0f} MB resident before any write"
    cache[:, :, :16] = 1.0
    assert int((cache != 0).sum()) == 16 * 8 * 16 * 64 and not cache[:, :, 16:].any()


@pytest.mark.parametrize("layout,kind", [("micro", "llama"), ("kernel", "llama"), ("kernel", "lfm2"),
                                        ("kernel", "qwen3_5"), ("kernel", "granite4h"), ("kernel", "deepseek_v3")])
def test_growing_the_cache_keeps_decoding_exact_and_measures_nothing(monkeypatch, layout, kind):
    """A cache too short for the rest of a generation grows mid-way (the used prefix
    copied, LFM2's convolution inputs with the KV): the continued AR tokens equal a fresh,
    big engine's, and nothing is measured again (step costs kept)."""
    model = tiny_model(kind, seed=2)
    engine = engine_or_skip(model, EngineConfig(width=8, capacity=64, row_layout=layout))
    step_costs = engine.costs.step_costs()
    _no_measuring(monkeypatch)
    prompt = list(range(3, 40))
    reference = Engine(model, EngineConfig(width=8, capacity=512, row_layout=layout)).generate_ar(prompt, 60)
    logits, _ = engine.prefill(prompt)
    tokens = [int(logits.argmax())]
    position = len(prompt)
    while len(tokens) < 60:
        if position + engine.width >= engine.capacity:
            engine.ensure_capacity(position + 64)  # copies every slot it has
        _, token, _ = engine.ar_step(tokens[-1], position)
        tokens.append(token)
        position += 1
    assert engine.capacity > 64
    assert tokens == reference
    assert engine.costs.step_costs() == step_costs
    assert engine.generate_ar(prompt, 60) == reference


def test_cache_is_sized_to_the_request_and_released(monkeypatch):
    """SelfSpecState.engine_for: the same engine serves a longer request (its cache grown,
    in whole key blocks, nothing measured), and a later short request shrinks a very large
    cache back to the configured size; tokens equal a fresh engine's throughout."""
    model = tiny_model("llama", seed=3)
    state = SelfSpecState(None, DecodeConfig(lookup="only"), EngineConfig(width=8, capacity=256))
    engine = state.engine_for(model, 100)
    assert engine.capacity == 256
    engine.costs.step_costs()  # (measured once, here)
    _no_measuring(monkeypatch)
    prompt = torch.randint(3, 256, (1500,), generator=torch.Generator().manual_seed(0)).tolist()
    assert state.engine_for(model, len(prompt) + 20 + 8) is engine
    assert engine.capacity >= len(prompt) + 28 and (engine.capacity + 1) % 256 == 0
    fresh = Engine(model, EngineConfig(width=8, capacity=2048, row_layout=engine.layout.name))
    assert engine.generate_ar(prompt, 20) == fresh.generate_ar(prompt, 20)
    assert state.engine_for(model, 100) is engine
    assert engine.capacity == 256 and engine.k_cache.shape[2] == 512
    short = list(range(3, 60))
    assert engine.generate_ar(short, 20) == fresh.generate_ar(short, 20)


def test_capacity_growth_stops_at_the_models_positions():
    model = tiny_model("llama", seed=3)
    engine = Engine(model, EngineConfig(width=8, capacity=64, row_layout="fixed"))
    engine.ensure_capacity(2040)
    assert engine.capacity == 2047  # whole key blocks with the trash slot
    engine.ensure_capacity(2048)
    assert engine.capacity == 2048  # max_position_embeddings, not the next key block
    assert engine.view.cos.shape[0] == 2048
    for bad in ({"need": 0}, {"need": 10, "keep": -1}, {"need": 10.5}):
        with pytest.raises(ValueError, match="need|keep"):
            engine.ensure_capacity(**bad)


# ---- the measurement cache on disk -------------------------------------------------------


def test_a_second_engine_reads_the_measurements(monkeypatch, cache_dir):
    """The layout choice and the step costs of a second engine for the same model come from
    the cache: no timing at all (the measuring functions raise)."""
    model = tiny_model("llama", seed=4)
    first = Engine(model, EngineConfig(width=8, capacity=256))
    first_costs = first.costs.step_costs()
    assert (cache_dir / measurement_cache.FILE_NAME).exists()
    _no_measuring(monkeypatch)
    second = Engine(model, EngineConfig(width=8, capacity=256))
    assert second.layout.name == first.layout.name
    assert second.costs.step_costs() == first_costs and second.costs.one_row_seconds() == first.costs.one_row_seconds()
    prompt = list(range(3, 40))
    assert second.generate_ar(prompt, 12) == first.generate_ar(prompt, 12)


def test_measurements_are_keyed_by_what_they_depend_on(monkeypatch):
    """Another width, dtype or thread count, or a disabled cache, measures again."""
    model = tiny_model("llama", seed=4)
    Engine(model, EngineConfig(width=8, capacity=256)).costs.step_costs()
    calls = []
    real = costs.measure_step_costs
    monkeypatch.setattr(costs, "measure_step_costs", lambda engine: calls.append(1) or real(engine))
    Engine(model, EngineConfig(width=4, capacity=256)).costs.step_costs()
    assert len(calls) == 1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        Engine(model, EngineConfig(width=8, capacity=256)).costs.step_costs()
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 2
    Engine(model, EngineConfig(width=8, capacity=256, measurement_cache=False)).costs.step_costs()
    assert len(calls) == 3
    monkeypatch.setenv("HF_SELFSPEC_NO_CACHE", "1")
    Engine(model, EngineConfig(width=8, capacity=256)).costs.step_costs()
    assert len(calls) == 4
    monkeypatch.delenv("HF_SELFSPEC_NO_CACHE")
    Engine(model, EngineConfig(width=8, capacity=256)).costs.step_costs()
    assert len(calls) == 4  # the first one's entry is still there


def test_a_layout_chosen_without_the_kernel_is_not_kept_once_it_loads(monkeypatch, cache_dir):
    """A process where the C++ kernel cannot load (no compiler yet) picks and caches a BLAS
    layout; a later one where it loads (the compiler installed, as the warning says) chooses
    again and gets the kernel, instead of the cached slower choice."""
    from hf_selfspec.kernels.cpu_rows import load_rows_linear

    from hf_selfspec.engine.layouts import LAYOUTS

    if load_rows_linear() is None:
        pytest.skip("the C++ row kernel cannot be built on this machine")
    model = tiny_model("llama", seed=4)
    with monkeypatch.context() as without_kernel:
        without_kernel.setattr(measurement_cache, "_cpu_kernel_loads", lambda: False)
        without_kernel.setattr(LAYOUTS["kernel"], "self_test", classmethod(lambda cls, linears: False))
        assert Engine(model, EngineConfig(width=8, capacity=256)).layout.name in ("micro", "fixed")
    # equal products: the kernel, the reference, is kept (a choice, not a cached answer)
    monkeypatch.setattr(costs, "gemm_seconds", lambda layout, linears, width, reps=3, give_up=None, per_rows=None: 1.0)
    assert Engine(model, EngineConfig(width=8, capacity=256)).layout.name == "kernel"


@pytest.mark.parametrize("corrupt", [
    "not json {", json.dumps([1, 2]), json.dumps({"format": 99, "entries": {}}),
    "ENTRY:{\"layout\": \"gemv\"}",
    "ENTRY:{\"prefill\": \"both\"}",
    "ENTRY:{\"step_costs\": {\"KEY\": {\"costs\": [1.0, 1.0, 0.5], \"one_row_seconds\": 0.01}}}",
    "ENTRY:{\"step_costs\": {\"KEY\": {\"costs\": \"COSTS_NAN\", \"one_row_seconds\": 0.01}}}",
    "ENTRY:{\"step_costs\": {\"KEY\": {\"costs\": \"COSTS_OK\", \"one_row_seconds\": -1}}}",
    "ENTRY:[1]",
    "ENTRY:{\"attention\": {\"KEY\": -1.0}}",
    "ENTRY:{\"batch_costs\": {\"KEY\": {\"rows\": [2, 8], \"costs\": [1.0, 1.5]}}}",
    "ENTRY:{\"batch_costs\": [1]}",
])
def test_a_corrupt_cache_is_ignored_with_a_warning(cache_dir, corrupt):
    """The cache file is untrusted: wrong JSON, format, layout names, cost lengths, values
    or ranges are ignored with a warning, measured again, and the file rewritten."""
    model = tiny_model("llama", seed=4)
    engine = Engine(model, EngineConfig(width=8, capacity=256))
    engine.costs.step_costs()
    path = cache_dir / measurement_cache.FILE_NAME
    if corrupt.startswith("ENTRY:"):
        data = json.loads(path.read_text())
        (digest, _entry), = data["entries"].items()
        key = f"{engine.layout.name}@{costs.cost_context(engine)}"
        text = corrupt[len("ENTRY:"):].replace("KEY", key)
        text = text.replace('"COSTS_NAN"', json.dumps([1.0] * 8) .replace("]", ", NaN]"))
        text = text.replace('"COSTS_OK"', json.dumps([1.0] * 9))
        data["entries"][digest] = json.loads(text)
        path.write_text(json.dumps(data))
    else:
        path.write_text(corrupt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = Engine(model, EngineConfig(width=8, capacity=256))
        costs_again = again.costs.step_costs()
    assert any("measurement cache" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert len(costs_again) == 9 and costs_again[1] == 1.0
    json.loads(path.read_text())  # rewritten, valid


# ---- stale engines -----------------------------------------------------------------------


def test_engine_for_rebuilds_after_dtype_or_new_weights():
    """`.to(float64)`, `.to(bfloat16)` and `load_state_dict(new tensors, assign=True)` after
    the first call rebuild the engine, whose tokens then equal a fresh engine's; an in-place
    edit of the same tensors keeps it (the engine reads them)."""
    model = tiny_model("llama", seed=5)
    config = EngineConfig(width=8, capacity=256)
    state = SelfSpecState(None, DecodeConfig(lookup="only"), config)
    prompt = list(range(3, 50))
    first = state.engine_for(model, 100)
    first.generate_ar(prompt, 8)
    assert state.engine_for(model, 100) is first
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    assert state.engine_for(model, 100) is first

    model.to(torch.float64)
    second = state.engine_for(model, 100)
    assert second is not first and second.view.dtype == torch.float64
    assert second.generate_ar(prompt, 16) == Engine(model, config).generate_ar(prompt, 16)

    other = tiny_model("llama", seed=6).to(torch.float64)
    model.load_state_dict(other.state_dict(), assign=True)
    third = state.engine_for(model, 100)
    assert third is not second
    assert third.generate_ar(prompt, 16) == Engine(other, config).generate_ar(prompt, 16)
    assert third.generate_ar(prompt, 16) == hf_greedy(other, prompt, 16)

    model.to(torch.bfloat16)
    fourth = state.engine_for(model, 100)
    assert fourth is not third and fourth.view.dtype == torch.bfloat16
    assert fourth.generate_ar(prompt, 16) == Engine(model, config).generate_ar(prompt, 16)


@pytest.mark.parametrize("layout", KEPT)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_decode_exactly(dtype, layout):
    """A bf16/fp16 model is served in its own dtype (weights and KV cache as stored, no fp32
    copy) by every layout whose self-test passes, and speculative decoding equals the
    engine's own AR decoding in that dtype."""
    model = tiny_model("llama", seed=7).to(dtype)
    engine = engine_or_skip(model, EngineConfig(width=8, capacity=256, row_layout=layout))
    assert engine.k_cache.dtype == dtype
    prompt = list(range(3, 60)) + list(range(3, 30))  # repeats: prompt lookup drafts
    reference = engine.generate_ar(prompt, 40)
    spec = SelfSpecDecoder(engine, None, DecodeConfig(lookup="only")).generate(prompt, 40)
    assert spec.tokens == reference
    assert spec.stats.drafted > 0


def test_auto_serves_bf16_with_the_kernel_where_it_builds():
    from hf_selfspec.kernels.cpu_rows import load_rows_linear

    if load_rows_linear() is None:
        pytest.skip("the C++ row kernel cannot be built on this machine")
    model = tiny_model("llama", seed=7).to(torch.bfloat16)
    engine = Engine(model, EngineConfig(width=8, capacity=256))
    assert engine.layout.name in ("kernel", "micro")  # micro only where its products are >10% cheaper


def _spy_prefills(monkeypatch) -> list[str]:
    """Which prefill each Engine.prefill call runs ("hf" / "engine"), in order."""
    used: list[str] = []
    for name in ("hf", "engine"):
        real = getattr(Engine, f"_prefill_{name}")
        monkeypatch.setattr(Engine, f"_prefill_{name}",
                            lambda self, *a, _real=real, _name=name, **k: used.append(_name) or _real(self, *a, **k))
    return used


@pytest.mark.parametrize("dtype, probe, expected", [
    (torch.float16, (1.0, 0.1), "engine"),  # PyTorch's float16 products on most CPUs: far dearer
    (torch.float16, (1.0, 0.9), "hf"),  # not clearly cheaper: HF's one pass stays
    (torch.bfloat16, (1.0, 0.1), "engine"),
    (torch.bfloat16, (0.1, 1.0), "hf"),  # AVX-512 BF16: HF's products are the cheaper
])
def test_auto_prefill_takes_the_engines_chunks_where_a_16_bit_models_products_measure_cheaper(
        monkeypatch, cache_dir, dtype, probe, expected):
    """EngineConfig(prefill="auto") on a 16-bit model with the row kernel: the engine's own
    W-row chunks prefill the prompt where the probe (one prompt chunk's largest product, HF's
    against the kernel's) says they are clearly cheaper, else HF's forward; either way the
    speculative tokens are the engine's own AR tokens, and a second engine reads the choice
    from the measurement cache without probing."""
    from hf_selfspec.kernels.cpu_rows import load_rows_linear

    if load_rows_linear() is None:
        pytest.skip("the C++ row kernel cannot be built on this machine")
    probed = []
    monkeypatch.setattr(costs, "prefill_product_seconds",
                        lambda linear, width, layout: probed.append(linear.weight.dtype) or probe)
    model = tiny_model("llama", seed=7).to(dtype)
    engine = Engine(model, EngineConfig(width=8, capacity=256, row_layout="kernel"))
    used = _spy_prefills(monkeypatch)
    prompt = list(range(3, 60)) + list(range(3, 30))  # repeats: prompt lookup drafts
    reference = engine.generate_ar(prompt, 24)
    spec = SelfSpecDecoder(engine, None, DecodeConfig(lookup="only")).generate(prompt, 24)
    assert spec.tokens == reference and spec.stats.drafted > 0
    assert used == [expected, expected] and engine.prefill_mode == expected and probed == [dtype]
    monkeypatch.setattr(costs, "prefill_product_seconds", lambda *a: pytest.fail("probed again"))
    assert Engine(model, EngineConfig(width=8, capacity=256, row_layout="kernel")).prefill_mode == expected


def test_auto_prefill_is_hfs_without_probing_for_float32_and_where_the_kernel_is_not_used(monkeypatch):
    """float32 (whose promise is HF's greedy tokens, the first one included) and every
    layout but the kernel prefill with HF's forward: nothing is probed; an explicit
    prefill is taken as given."""
    monkeypatch.setattr(costs, "prefill_product_seconds", lambda *a: pytest.fail("probed"))
    assert Engine(tiny_model("llama", seed=7), EngineConfig(width=8, capacity=256)).prefill_mode == "hf"
    half = tiny_model("llama", seed=7).to(torch.float16)
    assert Engine(half, EngineConfig(width=8, capacity=256, row_layout="fixed")).prefill_mode == "hf"
    assert engine_or_skip(half, EngineConfig(width=8, capacity=256, prefill="hf")).prefill_mode == "hf"
    assert Engine(half, EngineConfig(width=8, capacity=256, prefill="engine")).prefill_mode == "engine"


@pytest.mark.parametrize("kind", ["llama", "gpt2", "phi3"])
def test_the_prefill_probe_runs_on_every_kind_of_projection(kind):
    """The real probe on a float16 model whose largest projection is a plain matrix, a GPT-2
    Conv1D read transposed, or a row range of Phi-3's fused gate/up: HF's product and the
    kernel layout's W-row chunks each take a positive time, and a prompt then decodes to the
    engine's own AR tokens whichever prefill the probe chose."""
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(3)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=256,
                                           bos_token_id=1, eos_token_id=2)).eval()
    else:
        model = tiny_model(kind, seed=3)
    model = model.to(torch.float16)
    engine = engine_or_skip(model, EngineConfig(width=8, capacity=256, row_layout="kernel"))
    largest = max((lin for lw in engine.view.layers for lin in lw.linears), key=lambda lin: lin.weight.numel())
    hf, chunks = costs.prefill_product_seconds(largest, 8, engine.layout)
    assert 0 < hf < 10 and 0 < chunks < 10
    prompt = list(range(3, 80))
    reference = engine.generate_ar(prompt, 12)
    assert engine.prefill_mode in ("hf", "engine")
    assert SelfSpecDecoder(engine, None, DecodeConfig(lookup="only")).generate(prompt, 12).tokens == reference


# ---- refused models ----------------------------------------------------------------------


def test_quantized_models_are_refused_by_name():
    model = tiny_model("llama", seed=0)
    model.hf_quantizer = type("Bnb4BitHfQuantizer", (), {})()
    with pytest.raises(UnsupportedModelError, match="quantized .*Bnb4BitHfQuantizer"):
        LayeredModel(model, 64)
    del model.hf_quantizer
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(UnsupportedModelError, match="quantized .*gptq"):
        LayeredModel._check_features(model.config, 1)  # what attach_heads calls first


def test_wrapped_or_integer_projections_are_refused_by_name():
    class Linear8bit(torch.nn.Linear):
        pass

    model = tiny_model("llama", seed=0)
    old = model.model.layers[1].self_attn.k_proj
    model.model.layers[1].self_attn.k_proj = Linear8bit(old.in_features, old.out_features, bias=False)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj is a .*Linear8bit"):
        Engine(model, EngineConfig(width=8, capacity=64))
    model.model.layers[1].self_attn.k_proj = old
    model.lm_head.weight = torch.nn.Parameter(torch.zeros_like(model.lm_head.weight, dtype=torch.int8),
                                              requires_grad=False)
    with pytest.raises(ValueError, match="lm_head is a torch.nn.modules.linear.Linear .*int8"):
        LayeredModel.check_supported(model)


def test_config_replace_keeps_validation():
    """SelfSpecState builds engines with dataclasses.replace: the new fields validate too."""
    with pytest.raises(ValueError, match="executor"):
        dataclasses.replace(EngineConfig(), executor="graphs")
    with pytest.raises(ValueError, match="measurement_cache"):
        EngineConfig(measurement_cache="no")


def test_a_measurement_taken_on_a_busy_machine_is_taken_again(monkeypatch, cache_dir):
    """A cached 1-row step far slower than a step now (measured while other processes
    held the cores) would plan drafts on a wrong cost curve for good: it is measured again
    and the cache rewritten; a cached time like today's is kept (no measuring)."""
    model = tiny_model("llama", seed=4)
    Engine(model, EngineConfig(width=8, capacity=256)).costs.step_costs()
    path = cache_dir / measurement_cache.FILE_NAME

    def set_one_row(seconds):
        data = json.loads(path.read_text())

        def walk(node):
            if isinstance(node, dict):
                for key, value in node.items():
                    if key == "one_row_seconds":
                        node[key] = seconds
                    else:
                        walk(value)
        walk(data)
        path.write_text(json.dumps(data))

    calls = []
    real = costs.measure_step_costs
    monkeypatch.setattr(costs, "measure_step_costs", lambda engine: calls.append(1) or real(engine))
    def one_row_values(node):
        if isinstance(node, dict):
            return [v for k, v in node.items() if k == "one_row_seconds"] + [
                x for k, v in node.items() if k != "one_row_seconds" for x in one_row_values(v)]
        return []

    set_one_row(5.0)  # seconds: no step of this tiny model takes a fraction of that now
    engine = Engine(model, EngineConfig(width=8, capacity=256))
    assert engine.costs.one_row_seconds() < 5.0 / costs.STALE_FACTOR and len(calls) == 1
    assert min(one_row_values(json.loads(path.read_text()))) < 5.0 / costs.STALE_FACTOR  # rewritten
    Engine(model, EngineConfig(width=8, capacity=256)).costs.step_costs()
    assert len(calls) == 1  # the fresh entry is trusted


def test_the_busy_check_times_a_long_step_once():
    """The check of a cached 1-row time runs a warm-up and three steps (median) for a short
    step, one step for a long one (a big model's: each streams its weights)."""
    engine = Engine(tiny_model("llama", seed=4), EngineConfig(width=8, capacity=256, measurement_cache=False))
    steps = []
    real = engine.verify
    engine.verify = lambda *args, **kwargs: steps.append(1) or real(*args, **kwargs)
    assert costs.measured_while_busy(engine, 10 * costs.ONE_TIMING_ABOVE_SECONDS)  # 0.5 s: far slower than now
    assert len(steps) == 1
    assert not costs.measured_while_busy(engine, costs.CHECK_ABOVE_SECONDS / 2)  # too short to check
    assert len(steps) == 1
    costs.measured_while_busy(engine, costs.ONE_TIMING_ABOVE_SECONDS / 2)
    assert len(steps) == 5
