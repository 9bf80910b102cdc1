"""Batched generate(): HF batched greedy vs assistant="self" on the same left-padded batch.

For batch sizes 1, 2, 4, 8 (and 16 with --sizes), the first B prompts of a chat + code mix
(held-out ShareGPT first turns and HumanEval stubs, alternating) go through one
`model.generate` call each way, on the embedded SmolLM2-135M-Instruct with its shipped
heads. Printed per size (medians over --reps interleaved repetitions):

  tokens/s   new tokens of every row up to its EOS (the same count for both methods) over
             the call's wall time
  call s     the call's wall time (every sequence of a batch returns when the call does)
  identical  rows of the self batch equal to that prompt decoded alone with
             assistant="self" (bitwise: the promise), and to HF batch-1 greedy

Run: .venv/bin/python scripts/bench_batch.py [--sizes 1,2,4,8,16] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_selfspec import attach_heads  # noqa: E402
from hf_selfspec.data import prompt_sets, render_prompt  # noqa: E402
from hf_selfspec.defaults import load_default_model_and_tokenizer  # noqa: E402


def mixed_prompts(tokenizer, count: int) -> list[list[int]]:
    sets = prompt_sets(tokenizer, per_category=(count + 1) // 2, max_prompt_tokens=400)
    chat, code = sets["chat"], sets["code"]
    mixed = [p for pair in zip(chat, code) for p in pair][:count]
    return [render_prompt(tokenizer, m) for m in mixed]


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p):] = torch.tensor(p)
        mask[b, longest - len(p):] = 1
    return ids, mask


def new_rows(out: torch.Tensor, prompt_width: int, eos: set[int]) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS."""
    rows = []
    for row in out[:, prompt_width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    model, tokenizer = load_default_model_and_tokenizer()
    attach_heads(model)
    eos = {tokenizer.eos_token_id}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = mixed_prompts(tokenizer, max(sizes))
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)

    def generate(batch, **kw):
        ids, mask = left_padded(batch, pad)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **common, **kw)
        return new_rows(out, ids.shape[1], eos), time.perf_counter() - t0

    model.generate(torch.tensor([prompts[0]]), assistant="self", **common)  # engine build, batch costs
    model.generate(torch.tensor([prompts[:2][0]] * 2), assistant="self", **common)
    alone_self = [generate([p], assistant="self")[0][0] for p in prompts]
    alone_hf = [generate([p])[0][0] for p in prompts]

    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {args.max_new_tokens} new tokens, chat + code prompts")
    print(f"{'batch':>5} | {'HF tok/s':>8} | {'self tok/s':>10} | {'speed-up':>8} | {'HF call s':>9} | "
          f"{'self call s':>11} | {'= self alone':>12} | {'= HF batch-1':>12} | tau")
    for size in sizes:
        batch = prompts[:size]
        hf_t, self_t, identical, same_hf, taus = [], [], 0, 0, []
        for _ in range(args.reps):
            hf_rows, t_hf = generate(batch)
            self_rows, t_self = generate(batch, assistant="self")
            tokens = sum(len(r) for r in self_rows)
            hf_t.append((sum(len(r) for r in hf_rows), t_hf))
            self_t.append((tokens, t_self))
            taus.append(model.selfspec_stats.tau)
            identical = sum(r == a for r, a in zip(self_rows, alone_self[:size]))
            same_hf = sum(r == a for r, a in zip(self_rows, alone_hf[:size]))
        hf_rate = statistics.median(n / t for n, t in hf_t)
        self_rate = statistics.median(n / t for n, t in self_t)
        print(f"{size:>5} | {hf_rate:8.1f} | {self_rate:10.1f} | {self_rate / hf_rate:7.2f}x | "
              f"{statistics.median(t for _, t in hf_t):9.2f} | {statistics.median(t for _, t in self_t):11.2f} | "
              f"{identical:>5}/{size:<6} | {same_hf:>5}/{size:<6} | {statistics.median(taus):.2f}")


if __name__ == "__main__":
    main()
