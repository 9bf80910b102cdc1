"""The no-slowdown guard, per prompt: self-spec with and without the adaptive budget against
HF greedy and the engine's own AR loop, on text where the heads fail.

    python scripts/bench_guard.py --max-new-tokens 96 --reps 3

Prompts: the benchmark's adversarial set (random digits to continue; held-out ShareGPT user
turns in non-Latin scripts) and, for contrast, its chat prompts. Every method runs on the
same prompt side by side, order rotated per repetition; each cell is the median over the
repetitions of (HF greedy seconds / method seconds) for the same number of new tokens, so
< 1.00 is a slowdown. Output must be identical to HF greedy for every method.
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

METHODS = ("hf_greedy", "engine_ar", "self_unguarded", "self")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--categories", default="adversarial,chat")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model_and_tokenizer()
    attach_heads(model)
    guarded = selfspec_state(model).decode_config
    configs = {"self": guarded, "self_unguarded": replace(guarded, adaptive=False)}
    sets = prompt_sets(tokenizer, per_category=args.per_category)
    eos = tokenizer.eos_token_id
    rows = []
    for category in args.categories.split(","):
        for index, messages in enumerate(sets[category]):
            ids = torch.tensor([render_prompt(tokenizer, messages)])
            mask = torch.ones_like(ids)
            kw = dict(do_sample=False, max_new_tokens=args.max_new_tokens, attention_mask=mask)
            times = {m: [] for m in METHODS}
            outputs, taus = {}, {}
            for rep in range(args.reps):
                order = METHODS[rep % len(METHODS):] + METHODS[: rep % len(METHODS)]
                for method in order:
                    t0 = time.perf_counter()
                    if method == "hf_greedy":
                        out = model.generate(ids, **kw)[0, ids.shape[1]:].tolist()
                    elif method == "engine_ar":
                        engine = selfspec_state(model).engine_for(model, ids.shape[1] + args.max_new_tokens + 16)
                        out = engine.generate_ar(ids[0].tolist(), args.max_new_tokens, [eos])
                    else:
                        selfspec_state(model).decode_config = configs[method]
                        out = model.generate(ids, assistant="self", **kw)[0, ids.shape[1]:].tolist()
                        s = model.selfspec_stats
                        taus[method] = s.new_tokens / max(s.cycles + 1, 1)
                    times[method].append(time.perf_counter() - t0)
                    outputs[method] = out
            identical = all(outputs[m] == outputs["hf_greedy"] for m in METHODS)
            ratio = {m: statistics.median(h / t for h, t in zip(times["hf_greedy"], times[m])) for m in METHODS}
            # the guard's promise: never much slower than plain (engine AR) decoding
            ratio["self vs engine_ar"] = statistics.median(a / t for a, t in zip(times["engine_ar"], times["self"]))
            rows.append((category, index, len(outputs["hf_greedy"]), ratio, taus, identical))
            print(f"{category:<12}{index:>3}{len(outputs['hf_greedy']):>5}  "
                  + "  ".join(f"{m} {ratio[m]:.2f}" for m in METHODS[1:])
                  + f"  (self / engine_ar {ratio['self vs engine_ar']:.2f})"
                  + f"  tau {taus.get('self_unguarded', 0):.2f}/{taus.get('self', 0):.2f}  identical={identical}",
                  flush=True)
    print("\nSpeed vs HF greedy (median of reps; < 1.00 = slower), per category: worst prompt / median prompt")
    columns = METHODS[1:] + ("self vs engine_ar",)
    print(f"{'category':<12}" + "".join(f"{m:>26}" for m in columns))
    for category in args.categories.split(","):
        cat = [r for r in rows if r[0] == category]
        cells = []
        for m in columns:
            values = [r[3][m] for r in cat]
            cells.append(f"{min(values):>14.2f} / {statistics.median(values):<9.2f}")
        print(f"{category:<12}" + "".join(cells))
    print(f"identical to HF greedy: {sum(r[5] for r in rows)}/{len(rows)}")


if __name__ == "__main__":
    main()
