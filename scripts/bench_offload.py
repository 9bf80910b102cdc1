"""Models bigger than their memory, loaded with accelerate's device_map and disk offload:
generate(assistant="self") against HF greedy on the same dispatched model, same prompts,
side by side in one process.

    python scripts/bench_offload.py                                  # all three parts
    python scripts/bench_offload.py --parts default_all --prompts 4 --max-new-tokens 48

default_all:  the embedded default model (real weights, shipped heads: real acceptance) with
              every decoder layer on disk (embedding, final norm, LM head on the CPU).
default_half: the same with its last 15 of 30 layers on disk.
big:          a random-weight Llama of ~0.86B parameters, float32 (3.4 GB), loaded with
              device_map="auto" and max_memory={"cpu": --big-cpu-gb}: what does not fit goes
              to disk. Random weights accept no head draft: prompt lookup only, on prompts
              that repeat themselves.

Per part: seconds and tokens/s of HF greedy and of ours, tau (tokens per verification),
the mean rows per verification and the engine's width, the offloaded bytes each reads
per new token (HF's forward copies every offloaded weight in at each token; the engine
reads each once per verification, mapped in place where accelerate's index points at
float bytes of the layer's dtype, else copied in by accelerate's hooks), and the memory the
engine holds beyond what accelerate holds (its KV cache; the heads).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_selfspec
from hf_selfspec.data import prompt_sets, render_prompt
from hf_selfspec.defaults import default_model_dir

PARTS = ("default_all", "default_half", "big")
CATEGORIES = ("chat", "code", "summarize", "qa", "math", "translate")


def layer_map(layers: int, on_disk) -> dict:
    return {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
            **{f"model.layers.{i}": "disk" if i in on_disk else "cpu" for i in range(layers)}}


def streamed_bytes(placement) -> int:
    """Bytes of the weights accelerate streams in for one forward over every part."""
    total = 0
    for part in placement.parts:
        for module, _hook in part.streamed:
            for name, p in module.named_parameters(recurse=False):
                total += p.numel() * p.element_size()
    return total


def run_part(name: str, model, prompts: list[list[int]], max_new: int, heads, streamed_width: int) -> dict:
    hf_selfspec.attach_heads(model, heads=heads, engine=hf_selfspec.EngineConfig(streamed_width=streamed_width))
    warm = torch.tensor([prompts[0]])
    started = time.perf_counter()
    model.generate(warm, max_new_tokens=4, do_sample=False, assistant="self")  # engine build, costs
    build = time.perf_counter() - started
    engine = hf_selfspec.selfspec_state(model).engine
    placement = engine.view.placement
    moved = streamed_bytes(placement)
    rows = {"hf_s": [], "self_s": [], "new": [], "cycles": [], "drafted": [], "identical": 0}
    for prompt in prompts:
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        ref = model.generate(ids, max_new_tokens=max_new, do_sample=False)
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, assistant="self")
        t2 = time.perf_counter()
        stats = model.selfspec_stats
        rows["hf_s"].append(t1 - t0)
        rows["self_s"].append(t2 - t1)
        rows["new"].append(stats.new_tokens)
        rows["cycles"].append(stats.cycles)
        rows["drafted"].append(stats.drafted)
        rows["identical"] += int(torch.equal(ref, out))
        print(f"  {name}: prompt {len(rows['new'])}/{len(prompts)} ({len(prompt)} tokens): HF {t1 - t0:6.2f} s, "
              f"ours {t2 - t1:6.2f} s, x{(t1 - t0) / (t2 - t1):.2f}, "
              f"tau {stats.new_tokens / max(stats.cycles, 1):.2f}, "
              f"identical {torch.equal(ref, out)}", flush=True)
    new, cycles = sum(rows["new"]), sum(rows["cycles"])
    heads_bytes = 0 if hf_selfspec.selfspec_state(model).heads is None else sum(
        t.numel() * t.element_size() for t in hf_selfspec.selfspec_state(model).heads.state_dict().values())
    mapped = all(p.mapped is not None for p in placement.parts if p.offloaded)
    return {
        "part": name, "prompts": len(prompts), "identical": rows["identical"],
        "hf_tok_s": new / sum(rows["hf_s"]), "self_tok_s": new / sum(rows["self_s"]),
        "speedup": sum(rows["hf_s"]) / sum(rows["self_s"]),
        "median_speedup": statistics.median(h / s for h, s in zip(rows["hf_s"], rows["self_s"])),
        "tau": new / cycles, "rows_per_verify": 1 + sum(rows["drafted"]) / cycles, "width": engine.width,
        "layers_offloaded": f"{placement.offloaded_layers}/{len(placement.layers)}",
        "hf_gb_per_token": moved / 1e9, "self_gb_per_token": moved * cycles / new / 1e9,
        "read_as": "mapped in place" if mapped else "copied by accelerate's hooks",
        "kv_mb": (engine.k_cache.numel() * engine.k_cache.element_size()
                  * (1 if engine.v_cache is engine.k_cache else 2)) / 1e6,
        "heads_mb": heads_bytes / 1e6, "build_s": build,
    }


def default_prompts(tokenizer, n: int) -> list[list[int]]:
    sets = prompt_sets(tokenizer, per_category=max(1, -(-n // len(CATEGORIES))))
    picked = [sets[c][i] for i in range(max(len(v) for v in sets.values())) for c in CATEGORIES
              if c in sets and i < len(sets[c])]
    return [render_prompt(tokenizer, p) for p in picked[:n]]


def big_model_folder(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(folder)
    del model
    gc.collect()
    return folder


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per default-model part (one per category)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--big-prompts", type=int, default=2)
    ap.add_argument("--big-max-new-tokens", type=int, default=32)
    ap.add_argument("--big-cpu-gb", type=float, default=1.5, help="max_memory for the CPU in the big part")
    ap.add_argument("--streamed-width", type=int, default=hf_selfspec.EngineConfig().streamed_width,
                    help="EngineConfig.streamed_width: rows per step where weights stream in")
    ap.add_argument("--work", default=None, help="folder for the offload folders and the big model "
                    "(default: a temporary folder, removed after)")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        ap.error(f"--parts: unknown {unknown or 'none given'}; choose from {', '.join(PARTS)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(min(2, torch.get_num_threads()))
    work_dir = tempfile.TemporaryDirectory() if args.work is None else None
    work = Path(args.work or work_dir.name)
    results = []
    folder = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = default_prompts(tokenizer, args.prompts) if any(p.startswith("default") for p in parts) else []
    for part in parts:
        print(f"{part} ...", flush=True)
        if part.startswith("default"):
            on_disk = range(30) if part == "default_all" else range(15, 30)
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, device_map=layer_map(30, set(on_disk)),
                offload_folder=str(work / f"offload_{part}")).eval()
            results.append(run_part(part, model, prompts, args.max_new_tokens, None, args.streamed_width))
        else:
            big = big_model_folder(work / "big_llama")
            model = AutoModelForCausalLM.from_pretrained(
                big, dtype=torch.float32, device_map="auto", max_memory={"cpu": int(args.big_cpu_gb * 1e9)},
                offload_folder=str(work / "offload_big")).eval()
            # token ids that repeat a 24-token phrase: prompt lookup has something to copy
            phrase = [100 + (7 * i) % 3000 for i in range(24)]
            big_prompts = [[1] + (phrase * 3)[:48 + 8 * k] for k in range(args.big_prompts)]
            results.append(run_part(part, model, big_prompts, args.big_max_new_tokens, False, args.streamed_width))
        del model
        gc.collect()
    print()
    print(f"{'part':<13}{'layers off':>11}{'same':>6}{'HF tok/s':>10}{'ours tok/s':>11}{'x HF':>7}{'median x':>9}"
          f"{'tau':>6}{'rows/vfy':>9}{'width':>6}{'GB/tok HF':>10}{'GB/tok ours':>12}{'KV MB':>7}{'heads MB':>9}"
          f"{'build s':>8}  offloaded weights read")
    for r in results:
        print(f"{r['part']:<13}{r['layers_offloaded']:>11}{r['identical']:>3}/{r['prompts']:<2}{r['hf_tok_s']:>10.2f}"
              f"{r['self_tok_s']:>11.2f}{r['speedup']:>7.2f}{r['median_speedup']:>9.2f}{r['tau']:>6.2f}"
              f"{r['rows_per_verify']:>9.1f}{r['width']:>6}{r['hf_gb_per_token']:>10.3f}{r['self_gb_per_token']:>12.3f}"
              f"{r['kv_mb']:>7.1f}{r['heads_mb']:>9.1f}{r['build_s']:>8.1f}  {r['read_as']}")
    if work_dir is not None:
        work_dir.cleanup()


if __name__ == "__main__":
    main()
