"""LOSSY acceptance (DecodeConfig.lossy_top_k > 1) against the exact loop: speed and quality.

    python scripts/bench_lossy.py --per-category 3 --max-new-tokens 96

For each prompt, HF greedy and self-spec with lossy_top_k = 1 (exact), 2, 3 run side by side
(order rotated). Speed: HF greedy seconds / method seconds, over all prompts. Quality, per
method: outputs identical to greedy, the mean length of the prefix shared with greedy, and
the model's own mean negative log-likelihood per output token (teacher-forced HF forward;
greedy text is the reference, higher is worse).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_selfspec import attach_heads, selfspec_state  # noqa: E402
from hf_selfspec.data import prompt_sets, render_prompt  # noqa: E402
from hf_selfspec.defaults import load_default_model_and_tokenizer  # noqa: E402


@torch.no_grad()
def nll(model, prompt_ids, new_ids):
    ids = torch.tensor([prompt_ids + new_ids])
    logits = model(ids).logits[0, len(prompt_ids) - 1: -1].float()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(new_ids)))


def shared_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--categories", default="chat,code,summarize")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--top-k", default="1,2,3")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model_and_tokenizer()
    attach_heads(model)
    base = selfspec_state(model).decode_config
    ks = [int(k) for k in args.top_k.split(",")]
    methods = ["hf_greedy"] + [f"lossy_top_k={k}" for k in ks]
    configs = {f"lossy_top_k={k}": replace(base, lossy_top_k=k) for k in ks}
    sets = prompt_sets(tokenizer, per_category=args.per_category)
    seconds = {m: 0.0 for m in methods}
    tokens = {m: 0 for m in methods}
    quality = {m: {"identical": 0, "prefix": [], "nll": [], "tau": []} for m in methods}
    # untimed warm-up of every method (engine build, step-cost measurement, first calls)
    warm = torch.tensor([render_prompt(tokenizer, sets["chat"][0])])
    for m in methods:
        kw = dict(do_sample=False, max_new_tokens=8, attention_mask=torch.ones_like(warm))
        if m == "hf_greedy":
            model.generate(warm, **kw)
        else:
            selfspec_state(model).decode_config = configs[m]
            model.generate(warm, assistant="self", **kw)
    for category in args.categories.split(","):
        for i, messages in enumerate(sets[category]):
            prompt = render_prompt(tokenizer, messages)
            ids = torch.tensor([prompt])
            kw = dict(do_sample=False, max_new_tokens=args.max_new_tokens, attention_mask=torch.ones_like(ids))
            outs = {}
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            for m in order:
                t0 = time.perf_counter()
                if m == "hf_greedy":
                    out = model.generate(ids, **kw)
                else:
                    selfspec_state(model).decode_config = configs[m]
                    out = model.generate(ids, assistant="self", **kw)
                    quality[m]["tau"].append(model.selfspec_stats.tau)
                seconds[m] += time.perf_counter() - t0
                outs[m] = out[0, len(prompt):].tolist()
                tokens[m] += len(outs[m])
            for m in methods:
                q = quality[m]
                q["identical"] += outs[m] == outs["hf_greedy"]
                q["prefix"].append(shared_prefix(outs[m], outs["hf_greedy"]))
                q["nll"].append(nll(model, prompt, outs[m]))
            print(f"{category} {i}: " + "  ".join(
                f"{m} prefix {quality[m]['prefix'][-1]} nll {quality[m]['nll'][-1]:.3f}" for m in methods[1:]),
                flush=True)
    n = len(quality["hf_greedy"]["nll"])
    ref_rate = tokens["hf_greedy"] / seconds["hf_greedy"]
    print(f"\n{'method':<16}{'speed vs HF greedy':>20}{'tau':>7}{'identical':>11}"
          f"{'shared prefix':>15}{'NLL/token':>11}")
    for m in methods:
        q = quality[m]
        tau = f"{statistics.mean(q['tau']):.2f}" if q["tau"] else "-"
        print(f"{m:<16}{(tokens[m] / seconds[m]) / ref_rate:>19.2f}x{tau:>7}{q['identical']:>7}/{n:<3}"
              f"{statistics.mean(q['prefix']):>15.1f}{statistics.mean(q['nll']):>11.3f}")


if __name__ == "__main__":
    main()
