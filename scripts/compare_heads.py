"""Which heads folder drafts better end to end: tau (tokens per verification, deterministic)
and accepted drafts per category, with every output checked against HF greedy.

    python scripts/compare_heads.py hf_selfspec/default_heads /tmp/other_heads --per-category 3

Timing-free on purpose (tau does not depend on machine noise); speed goes through
scripts/bench.py --heads FOLDER.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_selfspec import attach_heads, detach_heads  # noqa: E402
from hf_selfspec.data import prompt_sets, render_prompt  # noqa: E402
from hf_selfspec.defaults import load_default_model_and_tokenizer  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--categories", default="chat,code,summarize,adversarial")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--lookup", default="first", help="DecodeConfig.lookup for every folder")
    ap.add_argument("--adaptive", choices=["on", "off"], default="on",
                    help="off: every draft / every tree row the heads propose (tau then does not "
                         "depend on the measured step costs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ordinary", action="store_true",
                    help="the model off the GGUF grid, as an ordinary checkpoint (bench.py --ordinary)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from hf_selfspec import DecodeConfig

    model, tokenizer = load_default_model_and_tokenizer()
    if args.ordinary:
        from bench import off_the_gguf_grid

        off_the_gguf_grid(model)
    sets = prompt_sets(tokenizer, per_category=args.per_category)
    categories = args.categories.split(",")
    prompts = [(c, render_prompt(tokenizer, m)) for c in categories for m in sets[c]]
    greedy = {}
    for i, (_, p) in enumerate(prompts):
        ids = torch.tensor([p])
        greedy[i] = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=args.max_new_tokens)[0, len(p):].tolist()
    print(f"{'heads':<40}" + "".join(f"{c:>13}" for c in categories) + f"{'all':>13}  identical")
    for folder in args.heads:
        attach_heads(model, folder, decode=DecodeConfig(lookup=args.lookup, adaptive=args.adaptive == "on"))
        per = {c: [0, 0] for c in categories}  # tokens, cycles
        identical = 0
        for i, (c, p) in enumerate(prompts):
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=args.max_new_tokens, assistant="self")[0, len(p):].tolist()
            identical += out == greedy[i]
            s = model.selfspec_stats
            per[c][0] += s.new_tokens - 1  # the prefill token is not a cycle's
            per[c][1] += s.cycles
        detach_heads(model)
        total = [sum(v[0] for v in per.values()), sum(v[1] for v in per.values())]
        cells = "".join(f"{t / max(n, 1):>13.2f}" for t, n in list(per.values()) + [total])
        print(f"{folder:<40}{cells}  {identical}/{len(prompts)}", flush=True)


if __name__ == "__main__":
    main()
