"""Models dispatched by accelerate (device_map, CPU and disk offload) under assistant="self".

Tiny random-weight models are saved and loaded back the way transformers documents for
models bigger than one device (`from_pretrained(folder, device_map=..., offload_folder=...)`):
greedy equals HF greedy on the same dispatched model (fp32), the engine's own AR in bf16,
every offloaded layer read through accelerate's offload (mapped in place, or its hooks'
copies), and what the engine cannot run refused at attach by name."""

from __future__ import annotations

import pytest
import torch
from accelerate.hooks import AlignDevicesHook, add_hook_to_module
from conftest import tiny_model
from transformers import AutoModelForCausalLM

import hf_selfspec
from hf_selfspec.engine.core import Engine, EngineConfig
from hf_selfspec.engine.devices import GroupedCache
from hf_selfspec.engine.dispatch import _align_hooks
from hf_selfspec.engine.layered import UnsupportedModelError, dispatch_placement

PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6, 7, 8, 11]


def _saved(tmp_path_factory, kind: str) -> str:
    folder = tmp_path_factory.mktemp(f"tiny_{kind}")
    tiny_model(kind, layers=4).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return _saved(tmp_path_factory, "llama")


def _layer_map(layers: int, offloaded, where: str = "disk") -> dict:
    """Every decoder layer of `offloaded` on `where`, the rest (and the other parts) on the CPU."""
    return {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
            **{f"model.layers.{i}": where if i in offloaded else "cpu" for i in range(layers)}}


def _load(folder, tmp_path, device_map, dtype=torch.float32, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device_map,
                                                offload_folder=str(tmp_path / "offload"), **kwargs).eval()


def _hf_then_self(model, prompt=PROMPT, new=24, **kwargs) -> tuple[list[int], list[int]]:
    ids = torch.tensor([prompt])
    ref = model.generate(ids, max_new_tokens=new, do_sample=False)[0].tolist()
    out = model.generate(ids, max_new_tokens=new, do_sample=False, assistant="self", **kwargs)[0].tolist()
    return ref, out


def test_offloaded_layers_greedy_equals_hf_greedy(llama_folder, tmp_path):
    """Half the layers on disk: the same tokens as HF greedy on the same dispatched model;
    the offloaded layers' weights are read in place, mapped from the checkpoint accelerate's
    index names."""
    model = _load(llama_folder, tmp_path, _layer_map(4, {1, 3}))
    hf_selfspec.attach_heads(model, heads=False)
    ref, out = _hf_then_self(model)
    assert out == ref
    engine = model._selfspec.engine
    placement = engine.view.placement
    assert [p.offloaded for p in placement.layers] == [False, True, False, True]
    if engine._fused_weights is not None:  # kernel layout: resident layers in C++, streamed as ops
        per = engine._fused_per_layer
        assert engine._fused_weights[per + 1].numel() == 0 and engine._fused_weights[1].numel() > 0
    assert all(placement.layers[i].mapped is not None for i in (1, 3))
    assert model._selfspec.engine.width == EngineConfig().streamed_width  # wide steps where weights stream
    # between steps the offloaded weights are back on the meta device: no second copy held
    assert model.model.layers[1].self_attn.q_proj.weight.device.type == "meta"


def test_everything_offloaded_auto_map(llama_folder, tmp_path):
    """device_map="auto" with too little CPU memory: accelerate puts the whole model on disk
    (embedding, final norm and LM head included); the engine brings each part in per use."""
    model = _load(llama_folder, tmp_path, "auto", max_memory={"cpu": 100_000})
    assert set(model.hf_device_map.values()) == {"disk"}
    hf_selfspec.attach_heads(model, heads=False)
    ref, out = _hf_then_self(model)
    assert out == ref
    placement = model._selfspec.engine.view.placement
    assert placement.embedding.offloaded and placement.lm_head.offloaded and placement.offloaded_layers == 4


def test_bf16_from_fp32_checkpoint_streams_through_accelerate_hooks(llama_folder, tmp_path):
    """Loaded in bf16 from a float32 checkpoint, the offloaded bytes are not the layers' (the
    dtype is converted at each load): accelerate's own hooks bring them in. Speculative
    output equals the engine's own AR output bit for bit (the 16-bit promise: HF's bf16
    greedy rounds its one-row products otherwise and may part at a near tie)."""
    model = _load(llama_folder, tmp_path, _layer_map(4, {0, 2}), dtype=torch.bfloat16)
    hf_selfspec.attach_heads(model, heads=False)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, assistant="self")[0]
    engine = model._selfspec.engine
    assert all(engine.view.placement.layers[i].mapped is None for i in (0, 2))
    assert out[len(PROMPT):].tolist() == engine.generate_ar(PROMPT, 24)


def test_other_family_fused_projections(tmp_path_factory, tmp_path):
    """Phi-3 (q/k/v and gate/up each one fused weight, read through row slices) with its
    layers alternating between the CPU and the disk."""
    folder = _saved(tmp_path_factory, "phi3")
    model = _load(folder, tmp_path, _layer_map(4, {0, 3}))
    hf_selfspec.attach_heads(model, heads=False)
    ref, out = _hf_then_self(model)
    assert out == ref


def test_batch_and_sampling_on_a_dispatched_model(llama_folder, tmp_path):
    """A batch of two prompts of different lengths: each row equals that prompt decoded
    alone; top_k=1 sampling is greedy (speculative sampling's exactness at its limit)."""
    model = _load(llama_folder, tmp_path, _layer_map(4, {1, 2}))
    hf_selfspec.attach_heads(model, heads=False)
    short = PROMPT[:9]
    alone = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, assistant="self")[0].tolist()
             for p in (PROMPT, short)]
    batch = torch.tensor([PROMPT, [0] * (len(PROMPT) - len(short)) + short])
    mask = (batch != 0).long()
    mask[0] = 1
    out = model.generate(batch, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant="self",
                         pad_token_id=0)
    assert out[0].tolist() == alone[0]
    assert out[1, len(PROMPT) - len(short):].tolist() == alone[1]
    torch.manual_seed(0)
    sampled = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=True, top_k=1,
                             assistant="self")[0].tolist()
    assert sampled == alone[0]


def test_engine_placement_and_memory(llama_folder, tmp_path):
    """The engine's view of a dispatched model: one execution device, the streamed layers
    named, no product of theirs timed or copied at build (step costs measured on real steps)."""
    model = _load(llama_folder, tmp_path, _layer_map(4, {0, 1, 2, 3}))
    engine = Engine(model, EngineConfig(capacity=128, width=8))
    assert engine.streams_weights and engine.view.streamed_layers == frozenset({0, 1, 2, 3})
    assert engine.compact is None  # nothing resident to read compactly
    assert len(engine.costs.step_costs()) == 9
    ar = engine.generate_ar(PROMPT, 8)
    assert ar == hf_greedy_tokens(model, PROMPT, 8)


def _over_two_devices(model, moved=("model.layers.2", "model.layers.3", "model.norm", "lm_head")):
    """The model's later parts executing on a second device, as a map over two GPUs puts
    them: here the CPU under another index (torch.device("cpu", 1)), so accelerate's hooks
    and the engine move rows and metadata between the two as they would between GPUs
    (moves between equal devices are no-ops) and keep one KV cache per device."""
    other = torch.device("cpu", 1)
    for name in moved:
        for sub in model.get_submodule(name).modules():
            for hook in _align_hooks(sub):
                hook.execution_device = other
    return model


def test_several_execution_devices_follow_the_map(llama_folder, tmp_path):
    """Layers over two devices (layer 1 disk-offloaded on the first): one KV cache per run
    of layers on its device, the step's metadata on each; greedy == HF greedy on the same
    dispatched model (chains and trees), a batch's rows each equal to their prompt alone."""
    model = _over_two_devices(_load(llama_folder, tmp_path, _layer_map(4, {1})))
    placement = dispatch_placement(model)
    assert placement.layer_devices == [torch.device("cpu")] * 2 + [torch.device("cpu", 1)] * 2
    hf_selfspec.attach_heads(model, heads=False)
    ref, out = _hf_then_self(model)
    assert out == ref
    engine = model._selfspec.engine
    assert [(g.lo, g.hi, g.device) for g in engine.groups] == [
        (0, 2, torch.device("cpu")), (2, 4, torch.device("cpu", 1))]
    assert isinstance(engine.k_cache, GroupedCache) and engine.head_device == torch.device("cpu", 1)
    # chains (no trees), on a longer prompt
    hf_selfspec.attach_heads(model, heads=False, decode=hf_selfspec.DecodeConfig(tree="off"))
    ref_long, out_long = _hf_then_self(model, prompt=PROMPT * 3, new=40)
    assert out_long == ref_long
    ids = torch.tensor([PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1, 2, 3, 4, 5, 6]])
    batch = model.generate(ids, max_new_tokens=16, do_sample=False, assistant="self").tolist()
    for row, prompt in zip(batch, ids.tolist()):
        assert row == model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0].tolist()


def test_heads_need_the_embedding_and_lm_head_on_one_device(llama_folder, tmp_path):
    model = _over_two_devices(_load(llama_folder, tmp_path, _layer_map(4, {1})))
    with pytest.raises(UnsupportedModelError, match="embedding on cpu and the LM head on cpu:1"):
        hf_selfspec.attach_heads(model, heads=str(tmp_path / "heads"))


def test_several_devices_bf16_equals_engine_ar(llama_folder, tmp_path):
    """bf16 over two devices, layer 0 streamed through accelerate's hooks (a bf16 load of an
    fp32 file), the final norm on the second device and the LM head back on the first."""
    model = _over_two_devices(_load(llama_folder, tmp_path, _layer_map(4, {0}), dtype=torch.bfloat16),
                              moved=("model.layers.2", "model.layers.3", "model.norm"))
    engine = Engine(model, EngineConfig(capacity=256))
    assert len(engine.groups) == 2 and engine.head_device == torch.device("cpu")
    ar = engine.generate_ar(PROMPT, 24)
    hf_selfspec.attach_heads(model, heads=False)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, assistant="self")
    assert out[0, len(PROMPT):].tolist() == ar


def hf_greedy_tokens(model, prompt, new):
    return model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, len(prompt):].tolist()


@pytest.mark.slow
def test_default_model_disk_offloaded_with_shipped_heads(default_model, tmp_path):
    """The real default model, every part on disk (device_map="auto", a small max_memory),
    loaded from its safetensors folder: attach_heads() recognises it (the weight fingerprint
    reads each offloaded part while accelerate brings it in), its shipped heads bind to the
    offloaded LM head and embedding, and greedy equals HF's greedy on the same weights."""
    from hf_selfspec.defaults import default_model_dir

    resident, tokenizer = default_model
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "List three primary colors."}],
                                        add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    model = _load(default_model_dir(), tmp_path, "auto", max_memory={"cpu": 10_000_000})
    assert set(model.hf_device_map.values()) == {"disk"}
    hf_selfspec.attach_heads(model)
    assert model._selfspec.heads is not None  # the shipped heads: the fingerprint matched
    out = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, assistant="self")
    ref = resident.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    assert out.tolist() == ref.tolist()
    assert model.selfspec_stats.accepted > 0


# ---- refusals: at attach, by name, before any work -------------------------------------

def _hook(module, device: str, offload: bool) -> None:
    add_hook_to_module(module, AlignDevicesHook(execution_device=torch.device(device), offload=offload,
                                                io_same_device=False))


def test_refuses_devices_of_several_kinds():
    model = tiny_model("llama", layers=4).eval()
    for i, layer in enumerate(model.model.layers):
        for sub in layer.modules():
            if list(sub.parameters(recurse=False)):
                _hook(sub, "cuda:0" if i >= 2 else "cpu", offload=i >= 2)
    with pytest.raises(UnsupportedModelError, match="devices of several kinds.*device_map='auto'"):
        hf_selfspec.attach_heads(model, heads=False)


def test_refuses_a_layer_split_across_devices():
    model = tiny_model("llama", layers=4).eval()
    for sub in model.model.layers[1].modules():
        if list(sub.parameters(recurse=False)):
            split = sub is model.model.layers[1].mlp.down_proj
            _hook(sub, "cuda:0" if split else "cpu", offload=split)
    with pytest.raises(UnsupportedModelError, match="decoder layer 1 is split across devices"):
        hf_selfspec.attach_heads(model, heads=False)


def test_refuses_quantized_offloaded_weights():
    model = tiny_model("llama", layers=4).eval()
    proj = model.model.layers[2].self_attn.q_proj
    add_hook_to_module(proj, AlignDevicesHook(execution_device=torch.device("cpu"), offload=True,
                                              weights_map={"weight": proj.weight.detach().to(torch.int8)}))
    with pytest.raises(UnsupportedModelError, match="quantized torch.int8 weights"):
        hf_selfspec.attach_heads(model, heads=False)


def test_refuses_a_tensor_parallel_plan():
    model = tiny_model("llama", layers=4).eval()
    _hook(model.model.layers[0], "cpu", offload=False)
    model._tp_size = 2  # what transformers records when tp_plan split the weights
    with pytest.raises(UnsupportedModelError, match="tensor-parallel plan"):
        hf_selfspec.attach_heads(model, heads=False)


def test_refuses_offloaded_recurrent_layers(tmp_path_factory, tmp_path):
    folder = _saved(tmp_path_factory, "lfm2")
    model = AutoModelForCausalLM.from_pretrained(
        folder, device_map={"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                            "model.layers.2": "cpu", "model.layers.3": "cpu", "model.embedding_norm": "cpu",
                            "model.rotary_emb": "cpu", "lm_head": "cpu"},
        offload_folder=str(tmp_path / "offload"))
    with pytest.raises(UnsupportedModelError, match="lfm2 with offloaded weights"):
        hf_selfspec.attach_heads(model, heads=False)


def test_undispatched_model_has_no_placement():
    model = tiny_model("llama", layers=2)
    assert dispatch_placement(model) is None


def test_offload_files_are_checked_before_use(tmp_path):
    """The bytes an offload index points to are input: a view is made only where the file's
    header agrees with the parameter (dtype, shape, byte range); anything else (another
    shape, a header that is not a table, random bytes, a range past the end) gives no view,
    and accelerate's own loader is used instead."""
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset
    from safetensors.torch import save_file

    from hf_selfspec.engine.dispatch import OffloadFiles

    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    good = tmp_path / "good.safetensors"
    save_file({"w": weight}, str(good))

    def view(path, like, name="w"):
        index = {"layer.weight": {"safetensors_file": str(path), "weight_name": name, "dtype": "float32"}}
        loader = OffloadedWeightsLoader(index=index, save_folder=str(tmp_path))
        return OffloadFiles().view(PrefixedDataset(loader, "layer."), "weight", like)

    found = view(good, torch.empty(3, 4, device="meta"))
    assert found is not None and torch.equal(found, weight)
    assert view(good, torch.empty(4, 3, device="meta")) is None  # same bytes, another shape
    assert view(good, torch.empty(3, 4, dtype=torch.bfloat16, device="meta")) is None
    assert view(good, torch.empty(3, 4, device="meta"), name="other") is None
    raw = good.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    for name, data in (("random", bytes(range(256)) * 8),
                       ("list_header", (2).to_bytes(8, "little") + b"[]"),
                       ("truncated", raw[:8 + header_len + 8]),
                       ("deep", (4000).to_bytes(8, "little") + b"[" * 2000 + b"]" * 2000)):
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(data)
        assert view(bad, torch.empty(3, 4, device="meta")) is None, name
