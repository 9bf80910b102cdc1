"""Weights mapped from the checkpoint file are moved into process memory at attach_heads
(engine/residence.py): same values, same Parameter objects, tying kept, file pages left,
output unchanged; views, shared mappings and oversized models are left alone."""

from __future__ import annotations

import torch
from conftest import hf_greedy, tiny_model

from hf_selfspec import attach_heads
from hf_selfspec.engine.residence import file_mapped_ranges, move_file_mapped_weights


def _in_ranges(t: torch.Tensor, ranges) -> bool:
    lo = t.data_ptr()
    return any(a <= lo < b for a, b in ranges)


def _saved_and_loaded(tmp_path, tie: bool):
    from transformers import AutoModelForCausalLM

    tiny_model(tie=tie).save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()


def test_a_loaded_checkpoint_is_moved_out_of_its_file_mapping(tmp_path):
    model = _saved_and_loaded(tmp_path, tie=True)
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    mapped = [n for n, p in params.items() if _in_ranges(p, file_mapped_ranges())]
    assert mapped, "transformers no longer maps safetensors checkpoints: nothing to test here"
    prompt = [5, 17, 33, 2 + 9, 60]
    reference = hf_greedy(model, prompt, 12)

    attach_heads(model, heads=False)
    ranges = file_mapped_ranges()
    assert not [n for n, p in model.named_parameters() if _in_ranges(p, ranges)]
    assert dict(model.named_parameters()).keys() == params.keys()
    for n, p in model.named_parameters():
        assert p is params[n]  # the same Parameter objects, new storage
        assert torch.equal(p, before[n])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    # each weight has a storage of its own (save_pretrained refuses shared ones)
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(storages) == len(set(storages))
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         assistant="self", pad_token_id=0)
    assert out[0, len(prompt):].tolist() == reference
    model.save_pretrained(tmp_path / "again")  # still a normal model


def test_views_shared_mappings_and_big_models_stay():
    model = tiny_model(layers=1)
    # every tensor of this random model "file-mapped": a range over all of them
    ptrs = [t.data_ptr() for t in model.state_dict().values()]
    everything = [(min(ptrs), max(ptrs) + 10**7)]
    assert move_file_mapped_weights(model, max_bytes=1000, ranges=everything) == 0
    assert [t.data_ptr() for t in model.state_dict().values()] == ptrs

    # two parameters viewing one storage at different offsets keep sharing it
    layer = model.model.layers[0].mlp
    base = torch.randn(2 * layer.up_proj.weight.numel())
    layer.up_proj.weight = torch.nn.Parameter(base[: layer.up_proj.weight.numel()].view_as(layer.up_proj.weight))
    layer.gate_proj.weight = torch.nn.Parameter(base[layer.gate_proj.weight.numel():].view_as(layer.gate_proj.weight))
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    everything = [(min(ptrs.values()), max(ptrs.values()) + 10**7)]
    moved = move_file_mapped_weights(model, ranges=everything)
    assert moved > 0
    after = {n: p.data_ptr() for n, p in model.named_parameters()}
    views = {n for n in ptrs if "up_proj" in n or "gate_proj" in n}
    assert all(after[n] == ptrs[n] for n in views)
    assert all(after[n] != ptrs[n] for n in ptrs if n not in views)
    assert layer.up_proj.weight.untyped_storage().data_ptr() == layer.gate_proj.weight.untyped_storage().data_ptr()


def test_maps_parsing_keeps_private_file_mappings_only(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0000100000 r--p 00000000 fe:00 1234    /data/model.safetensors\n"
        "7f0000200000-7f0000300000 rw-s 00000000 00:05 99      /dev/shm/torch_1\n"
        "7f0000400000-7f0000500000 rw-p 00000000 00:00 0\n"
        "7f0000600000-7f0000700000 rw-p 00000000 00:00 0       [heap]\n")
    assert file_mapped_ranges(maps) == [(0x7F0000000000, 0x7F0000100000)]
    assert file_mapped_ranges(tmp_path / "missing") == []
