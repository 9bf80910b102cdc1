"""The GPU step of issue 53: a model accelerate dispatches over GPU 0, the CPU and the disk.

A random-weight Llama is saved and loaded back with a device_map that puts its first
layers on GPU 0 and the rest in CPU memory and on disk (accelerate streams those to GPU 0
at every forward); generate(assistant="self") must equal HF greedy on the same dispatched
model (fp32) and the engine's own AR output (bf16). Also device_map="auto" with a small
max_memory for GPU 0. Prints one line per case and exits non-zero on any difference.

    python scripts/gpu_offload_check.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_selfspec


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_offload_check: no CUDA device; nothing to check")
        return 0
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6, 7, 8, 11] * 2])
    failed = 0
    with tempfile.TemporaryDirectory() as work:
        LlamaForCausalLM(config).save_pretrained(work)
        split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0,
                 **{f"model.layers.{i}": 0 if i < 2 else ("cpu" if i < 4 else "disk") for i in range(6)}}
        cases = [("gpu+cpu+disk fp32", split, None, torch.float32),
                 ("gpu+cpu+disk bf16", split, None, torch.bfloat16),
                 ("auto, small GPU memory", "auto", {0: 2_000_000, "cpu": 10**9}, torch.float32)]
        for name, device_map, memory, dtype in cases:
            model = AutoModelForCausalLM.from_pretrained(
                work, dtype=dtype, device_map=device_map, max_memory=memory,
                offload_folder=f"{work}/offload_{len(name)}").eval()
            ids = prompt.to("cuda:0")
            ref = model.generate(ids, max_new_tokens=32, do_sample=False)
            hf_selfspec.attach_heads(model, heads=False)
            started = time.perf_counter()
            out = model.generate(ids, max_new_tokens=32, do_sample=False, assistant="self")
            seconds = time.perf_counter() - started
            engine = hf_selfspec.selfspec_state(model).engine
            ar = engine.generate_ar(prompt[0].tolist(), 32)
            same_ar = out[0, prompt.shape[1]:].tolist() == ar
            same_hf = torch.equal(out, ref)
            ok = same_ar and (same_hf or dtype != torch.float32)
            failed += not ok
            print(f"{name}: map {sorted(set(map(str, model.hf_device_map.values())))}, engine on {engine.view.device}, "
                  f"width {engine.width}, {engine.view.placement.describe()}: == HF greedy {same_hf}, == engine AR "
                  f"{same_ar}, {seconds:.2f} s, stats {model.selfspec_stats.cycles} cycles -> "
                  f"{'OK' if ok else 'FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
