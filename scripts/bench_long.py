"""Long prompts: HF greedy vs generate(assistant="self") at 0.5k-4k prompt tokens.

    python scripts/bench_long.py                      # 512, 1024, 2048, 3584 tokens, 64 new
    python scripts/bench_long.py --lengths 512,4000 --max-new-tokens 64 --reps 2

Prompts are held-out ShareGPT conversations concatenated into one request, cut to the length,
with the instruction to summarize them last. For each length, in order of increasing length in one process: the
FIRST self-spec call at that length (the engine's KV cache must grow to it) and a warm
call, each against HF greedy on the same prompt, side by side; the time split is prefill
(the prompt through the model) and decoding. Every output is checked against HF greedy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_selfspec import attach_heads  # noqa: E402
from hf_selfspec.data import sharegpt_conversations, split_of  # noqa: E402
from hf_selfspec.defaults import load_default_model_and_tokenizer  # noqa: E402


def long_prompt(tokenizer, length: int) -> list[int]:
    """A chat prompt of exactly `length` tokens: held-out conversations, then the request to
    summarize them (the request last, so that the reply is a summary, not an early EOS)."""
    text = []
    for conversation in sharegpt_conversations():
        if split_of(conversation.id) != "eval":
            continue
        text.extend(m["content"] for m in conversation.messages)
        if sum(len(t) for t in text) > length * 6:
            break
    marker = "<<BODY>>"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Here is a conversation:\n\n{marker}\n\n"
                                     "Summarize the conversation above in five sentences."}],
        tokenize=False, add_generation_prompt=True)
    before, after = chat.split(marker)
    head = tokenizer(before, add_special_tokens=False)["input_ids"]
    tail = tokenizer(after, add_special_tokens=False)["input_ids"]
    body = tokenizer("\n\n".join(text), add_special_tokens=False)["input_ids"]
    return head + body[: length - len(head) - len(tail)] + tail


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1024,2048,3584")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="warm repetitions (median)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model_and_tokenizer()
    attach_heads(model)
    greedy = dict(do_sample=False, max_new_tokens=args.max_new_tokens)
    warm = torch.tensor([long_prompt(tokenizer, 64)])
    model.generate(warm, **greedy, attention_mask=torch.ones_like(warm))  # process warm-up, untimed
    model.generate(warm, **greedy, attention_mask=torch.ones_like(warm), assistant="self")
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        ids = torch.tensor([long_prompt(tokenizer, length)])
        mask = torch.ones_like(ids)
        hf, hf_s = timed(lambda: model.generate(ids, attention_mask=mask, **greedy))
        first, first_s = timed(lambda: model.generate(ids, attention_mask=mask, assistant="self", **greedy))
        first_stats = model.selfspec_stats
        warm_times, hf_times = [], [hf_s]
        for _ in range(args.reps):
            out, s = timed(lambda: model.generate(ids, attention_mask=mask, assistant="self", **greedy))
            warm_times.append(s)
            _, h = timed(lambda: model.generate(ids, attention_mask=mask, **greedy))
            hf_times.append(h)
        stats = model.selfspec_stats
        new = hf.shape[1] - ids.shape[1]
        hf_med = statistics.median(hf_times)
        warm_med = statistics.median(warm_times)
        rows.append({
            "prompt": ids.shape[1], "new": new, "hf_s": hf_med, "first_s": first_s, "warm_s": warm_med,
            "first_x": hf_med / first_s, "warm_x": hf_med / warm_med,
            "first_build": first_stats.build_time, "prefill": stats.prefill_time,
            "decode": stats.total_time - stats.prefill_time, "tau": stats.tau,
            "same": torch.equal(hf, first) and torch.equal(hf, out)})
        r = rows[-1]
        print(f"[{r['prompt']} tok] HF {r['hf_s']:.2f} s | self first {r['first_s']:.2f} s ({r['first_x']:.2f}x, "
              f"build {r['first_build']:.2f} s) | warm {r['warm_s']:.2f} s ({r['warm_x']:.2f}x: prefill "
              f"{r['prefill']:.2f} s + decode {r['decode']:.2f} s, tau {r['tau']:.2f}) | same {r['same']}", flush=True)
    print("\n| prompt tokens | HF greedy s | self first call s (x HF) | self warm s (x HF) | warm prefill / decode s "
          "| tau | identical |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt']} | {r['hf_s']:.2f} | {r['first_s']:.2f} ({r['first_x']:.2f}x) | "
              f"{r['warm_s']:.2f} ({r['warm_x']:.2f}x) | {r['prefill']:.2f} / {r['decode']:.2f} | "
              f"{r['tau']:.2f} | {r['same']} |")


if __name__ == "__main__":
    main()
