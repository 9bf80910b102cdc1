"""Record decode traces of the default model with its shipped heads, for replay on a GPU.

No real checkpoint reaches the GPU machine (no network, 64 MiB of carried files), so what
a real model would do there is predicted: this script decodes a prompt mix on the CPU with
the embedded SmolLM2-135M-Instruct and its shipped top-layer heads, greedy, the shipped
decode policy, and writes per decode cycle what the GPU must replay:

    position      the last committed token's position (the verify rows' context)
    rows          rows verified (row 0 = the last committed token, then the drafts)
    committed     tokens this cycle committed
    head_budget   how deep the heads drafted this cycle (0: not evaluated)
    parents       the draft tree's parent of each row (null: a chain)
    accepted      the rows whose scores gave the committed tokens (root first): the
                  accepted path, whose KV is compacted after a tree cycle

and per prompt its length and how many forward passes HF's prompt lookup
(`prompt_lookup_num_tokens=10`) took for the same tokens (a forward hook counts them).
`scripts/gpu_check.py --replay-only` replays the cycles through the engine's executor on
random-weight models of this shape and of a 1B-class shape (docs/gpu.md).

Two traces: the policy planning with this CPU's measured step costs ("cpu"), and with a
GPU's width curve (`GPU_ROW_COSTS`: rows nearly free, so the policy keeps more rows), the
plan the engine would make on the GPU. Tokens are the same either way (exactness); only
which rows are verified differs.

    python scripts/record_traces.py                 # 4 prompts per category, 128 new tokens
    python scripts/record_traces.py --per-category 1 --max-new-tokens 32 --out /tmp/t.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_selfspec import attach_heads, selfspec_state
from hf_selfspec.data import prompt_sets, render_prompt
from hf_selfspec.decoding.cycle import SelfSpecDecoder
from hf_selfspec.decoding.drafters import HEADS_KEY
from hf_selfspec.defaults import DEFAULT_MODEL_ID, load_default_model_and_tokenizer

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "traces_smollm2.json.gz"
CATEGORIES = ("chat", "code", "summarize")
# Verify cost of 1..8 rows in one-row steps on an H200 (docs/gpu.md, "What width costs on
# this GPU": 1, 2, 4, 8 rows measured; 3, 5, 6, 7 interpolated); index 0 is 1 row, as in
# engine.costs.step_costs().
GPU_ROW_COSTS = (1.0, 1.0, 1.06, 1.07, 1.08, 1.09, 1.10, 1.11, 1.12)
FORMAT_VERSION = 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--per-category", type=int, default=4, help="prompts per category")
    p.add_argument("--categories", default=",".join(CATEGORIES), help="prompt_sets categories")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trace does not depend on them)")
    p.add_argument("--no-hf-lookup", action="store_true", help="skip counting HF prompt lookup's passes")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output (.json or .json.gz)")
    return p.parse_args(argv)


def cycles_from_events(events: list[tuple]) -> list[dict]:
    """The decoder's trace events (SelfSpecDecoder.trace) -> one list per prompt of cycles
    [position, rows, committed, head_budget, parents | None, accepted]; "draft" events
    before a "verify" belong to its cycle."""
    prompts: list[dict] = []
    budget = 0
    for event in events:
        if event[0] == "prompt":
            prompts.append({"prompt_tokens": event[1], "cycles": []})
            budget = 0
        elif event[0] == "draft":
            if event[1] == HEADS_KEY:
                budget += event[2]
        elif event[0] == "verify":
            _, position, parents, accepted, committed = event
            chain = all(p == i - 1 for i, p in enumerate(parents))
            prompts[-1]["cycles"].append([position, len(parents), committed, budget,
                                          None if chain else parents, accepted])
            budget = 0
    return prompts


def count_hf_lookup_passes(model, ids: torch.Tensor, max_new: int) -> dict:
    """HF's prompt-lookup decoding of `ids`: its tokens, model forward passes and the rows
    they took (a forward pre-hook counts them)."""
    passes, rows = [0], [0]

    def hook(module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        passes[0] += 1
        rows[0] += int(x.shape[1]) if x is not None else 0

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new, prompt_lookup_num_tokens=10)
    finally:
        handle.remove()
    tokens = out[0, ids.shape[1]:].tolist()
    # the first pass is the prefill (all prompt rows): not a decode step
    return {"tokens": tokens, "passes": passes[0] - 1, "rows": rows[0] - ids.shape[1]}


def record(model, prompts: list[list[int]], max_new: int, eos: list[int], row_costs=None) -> tuple[list, list, bool]:
    """Decode each prompt as generate(assistant="self") would (the attached state's heads,
    decode policy and engine), recording the loop's events. row_costs: the policy plans
    with these step costs instead of the engine's measured ones. -> (prompts' cycles,
    tokens, whether the cycles drafted trees)."""
    state = selfspec_state(model)
    tokens = []
    events: list[tuple] = []
    trees = False
    for prompt in prompts:
        engine = state.engine_for(model, len(prompt) + max_new + state.engine_config.width)
        if row_costs is not None:
            engine.costs.step_costs_at = lambda context, batched=False: tuple(row_costs)
        decoder = SelfSpecDecoder(engine, state.heads, state.decode_config)
        decoder.trace = events
        trees = decoder.use_tree
        try:
            tokens.append(decoder.generate(prompt, max_new, eos).tokens)
        finally:
            vars(engine.costs).pop("step_costs_at", None)
    return cycles_from_events(events), tokens, trees


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer = load_default_model_and_tokenizer()
    attach_heads(model)  # the shipped heads
    state = selfspec_state(model)
    if state.engine_config.width + 1 != len(GPU_ROW_COSTS):
        raise SystemExit(f"GPU_ROW_COSTS has {len(GPU_ROW_COSTS)} entries for width {state.engine_config.width}")
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    categories = [c for c in args.categories.split(",") if c]
    sets = prompt_sets(tokenizer, per_category=args.per_category)
    prompts, labels = [], []
    for cat in categories:
        for messages in sets[cat][: args.per_category]:
            prompts.append(render_prompt(tokenizer, messages))
            labels.append(cat)

    traces = {}
    reference = None
    for name, costs in (("cpu", None), ("gpu", GPU_ROW_COSTS)):
        cycles, tokens, tree_mode = record(model, prompts, args.max_new_tokens, eos, costs)
        if reference is not None and tokens != reference:  # exactness: the plan never changes a token
            raise SystemExit(f"trace {name!r}: tokens differ from the first trace's")
        reference = tokens
        for entry, cat, out in zip(cycles, labels, tokens):
            entry["category"] = cat
            entry["new_tokens"] = len(out)
            if sum(c[2] for c in entry["cycles"]) != len(out) - 1:  # the first token: prefill
                raise SystemExit("trace: committed tokens do not add up to the output")
        traces[name] = cycles
        n_cycles = sum(len(p["cycles"]) for p in cycles)
        n_tokens = sum(p["new_tokens"] for p in cycles)
        print(f"[{name}] {len(cycles)} prompts, {n_tokens} tokens, {n_cycles} cycles, "
              f"tau {(n_tokens - len(cycles)) / max(n_cycles, 1):.2f}", flush=True)

    hf_lookup = []
    if not args.no_hf_lookup:
        for prompt, out in zip(prompts, reference):
            counted = count_hf_lookup_passes(model, torch.tensor([prompt]), args.max_new_tokens)
            hf_lookup.append({"passes": counted["passes"], "rows": counted["rows"],
                              "new_tokens": len(counted["tokens"]),
                              "identical": counted["tokens"] == out})
        print(f"[hf prompt lookup] {sum(h['passes'] for h in hf_lookup)} decode passes for "
              f"{sum(h['new_tokens'] for h in hf_lookup)} tokens", flush=True)

    data = {
        "format": FORMAT_VERSION,
        "model": DEFAULT_MODEL_ID,
        "heads": "shipped (hf_selfspec/default_heads)",
        "width": state.engine_config.width,
        "max_new_tokens": args.max_new_tokens,
        "decode_config": {k: v for k, v in vars(state.decode_config).items()
                          if isinstance(v, (int, float, str, bool, type(None)))},
        # the heads drafted trees (DraftContext.tree), not only chains
        "tree_mode": tree_mode,
        "cycle_fields": ["position", "rows", "committed", "head_budget", "parents", "accepted"],
        "gpu_row_costs": list(GPU_ROW_COSTS),
        "traces": traces,
        "hf_prompt_lookup": hf_lookup,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, separators=(",", ":"))
    if out.suffix == ".gz":
        # mtime=0: the same trace gives the same bytes (a re-run leaves git clean)
        out.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        out.write_text(text)
    print(f"wrote {out} ({out.stat().st_size / 1e3:.1f} kB) in {time.perf_counter() - t0:.0f} s")
    return 0


def load_traces(path: str | Path) -> dict:
    """A file written by this script (.json or .json.gz)."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    data = json.loads(raw)
    if data.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: trace format {data.get('format')!r}, expected {FORMAT_VERSION}")
    return data


if __name__ == "__main__":
    sys.exit(main())
