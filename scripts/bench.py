"""Benchmark: hf_selfspec vs Hugging Face decoding on the embedded default model.

    python scripts/bench.py                       # all categories, all methods
    python scripts/bench.py --per-category 2 --max-new-tokens 64 --methods hf_greedy,self
    python scripts/bench.py --widths               # also the cost of a step vs its rows
    python scripts/bench.py --roofline             # also bytes per step over measured bandwidth
    python scripts/bench.py --methods hf_greedy,self,llama_cpp_greedy,llama_cpp_lookup
                                                   # llama.cpp as a peer (pip install llama-cpp-python)
    python scripts/bench.py --model HF_FOLDER --draft-model SMALLER_HF_FOLDER
                                                   # another model (no heads: prompt lookup),
                                                   # + HF assisted generation vs self-spec with
                                                   # the same draft model (same tokenizer)

Every method runs on the same prompt side by side in one process (methods rotated per
prompt, so drift in machine speed hits all alike); the table gives per category the median
tokens/s, the ratio of total time to HF greedy, tau (tokens per verification), how many
outputs are identical to HF greedy, and where self-spec time goes. With --out FILE.json the
records are saved there as JSON (and a PNG plot beside it when matplotlib is installed);
without it nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama_cpp_peer

from hf_selfspec import attach_heads, selfspec_state  # noqa: E402
from hf_selfspec.data import prompt_sets, render_prompt  # noqa: E402
from hf_selfspec.defaults import load_default_model_and_tokenizer  # noqa: E402

METHODS = ("hf_greedy", "hf_prompt_lookup", "hf_early_exit", "engine_ar", "self_heads",
           "self_lookup", "self")
DRAFT_METHODS = ("hf_assisted", "self_draft_model")  # need --draft-model
# llama.cpp greedy and its prompt-lookup decoding on an F32 GGUF of the same weights
# (scripts/llama_cpp_peer.py; needs llama-cpp-python, benchmark-only)
PEER_METHODS = ("llama_cpp_greedy", "llama_cpp_lookup")
# sampling at temperature 0.7, top-p 0.9, the same seed for both per prompt: HF's and self-spec's
# (exact in distribution, not token for token: their `same` column is "-"; `x HF` stays HF greedy's,
# and a line after the tables gives self_sample against hf_sample)
SAMPLE_METHODS = ("hf_sample", "self_sample")
SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.9)
# draft structures, each = the shipped default policy with one change (--methods to pick)
TREE_METHODS = ("self_chain", "self_tree", "self_tree_merge", "self_tree_sib1", "self_tree_beam1",
                "self_heads_tree", "self_heads_chain", "self_heads_fixed", "self_heads_fixed_tree")
SELF_DECODE = {
    "self_heads": dict(lookup="off"),
    "self_lookup": dict(lookup="only"),
    "self": {},  # the shipped default policy
    "self_chain": dict(tree="off"),  # chains: copies pre-empt heads or heads draft alone
    "self_tree": dict(tree="on"),  # heads' dynamic tree + lookup copy, one trie
    "self_tree_merge": dict(tree="on", siblings=0),  # heads' chain + lookup copy only
    "self_tree_sib1": dict(tree="on", siblings=1, sibling_min_prob=0.1),
    "self_tree_beam1": dict(tree="on", tree_beam=1),  # only the likeliest node of a step expanded
    "self_heads_tree": dict(tree="on", lookup="off"),  # heads alone: their dynamic tree
    "self_heads_chain": dict(tree="off", lookup="off"),  # heads alone: their chain
    "self_heads_fixed": dict(lookup="off", adaptive=False, tree="off"),  # heads alone, every draft, chains
    "self_heads_fixed_tree": dict(lookup="off", adaptive=False, tree="on"),  # every row of their tree
}


def run_method(method, model, ids, max_new, state):
    """-> (new token ids, seconds, stats dict or None)."""
    mask = torch.ones_like(ids)
    greedy = dict(do_sample=False, max_new_tokens=max_new, attention_mask=mask)
    t0 = time.perf_counter()
    stats = None
    if method == "hf_greedy":
        out = model.generate(ids, **greedy)
    elif method == "hf_prompt_lookup":
        out = model.generate(ids, prompt_lookup_num_tokens=10, **greedy)
    elif method == "hf_assisted":  # HF's classical assisted generation with the draft model
        out = model.generate(ids, assistant_model=state["draft_model"], **greedy)
    elif method == "self_draft_model":
        selfspec_state(model).decode_config = state["decode"]["self"]
        out = model.generate(ids, assistant="self", assistant_model=state["draft_model"], **greedy)
        stats = model.selfspec_stats.as_dict()
    elif method == "hf_early_exit":
        out = model.generate(ids, assistant_early_exit=state["early_exit_layer"], **greedy)
    elif method in SAMPLE_METHODS:
        torch.manual_seed(state["seed"])
        sampling = dict(SAMPLING, max_new_tokens=max_new, attention_mask=mask)
        if method == "hf_sample":
            out = model.generate(ids, **sampling)
        else:
            selfspec_state(model).decode_config = state["decode"]["self"]
            out = model.generate(ids, assistant="self", **sampling)
            stats = model.selfspec_stats.as_dict()
    elif method in PEER_METHODS:
        tokens, seconds = state["peers"][method].generate(ids[0].tolist(), max_new, set(state["eos"]))
        return tokens, seconds, None
    elif method == "engine_ar":
        engine = selfspec_state(model).engine_for(model, ids.shape[1] + max_new + 16)
        tokens = engine.generate_ar(ids[0].tolist(), max_new, state["eos"])
        return tokens, time.perf_counter() - t0, None
    else:
        selfspec_state(model).decode_config = state["decode"][method]
        out = model.generate(ids, assistant="self", **greedy)
        stats = model.selfspec_stats.as_dict()
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - t0, stats


def verify_ms(engine, prompt, rows, reps, logits=False):
    """Median ms of a verify step of `rows` rows over all layers, after the prefilled `prompt`:
    as greedy decoding runs it (each row's argmax only: the LM head's int8 screen where
    the engine has one), or with the float32 logits (logits=True: sampling, processors)."""
    times = []
    for _ in range(reps):
        meta = engine.make_meta(range(len(prompt), len(prompt) + rows))
        h = engine.embed(prompt[:rows])
        t0 = time.perf_counter()
        engine.verify(h, 0, meta, logits=logits)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def text_context(tokenizer, sets, n: int) -> list[int]:
    """n tokens of real text (the benchmark's rendered prompts one after another): the rows a
    step verifies then end in hidden states like the decoder's, so the LM head's screen sees
    what it sees in decoding (a synthetic run of ids gives near-flat distributions, rows with
    hundreds of candidates)."""
    ids: list[int] = []
    for prompts in sets.values():
        for messages in prompts:
            ids += render_prompt(tokenizer, messages)
            if len(ids) >= n:
                return ids[:n]
    raise ValueError(f"the prompt sets hold fewer than {n} tokens")


def width_curve(model, widths, prompt, reps=9):
    """ms of a verify step over all layers vs its number of rows, after `prompt`."""
    engine = selfspec_state(model).engine_for(model, 1024)
    engine.prefill(prompt)
    rows = [(n, verify_ms(engine, prompt, n, reps)) for n in widths if n <= engine.width]
    base = rows[0][1]
    print("\nStep cost vs rows (verify over all layers, median of %d):" % reps)
    print(f"{'rows':>5} {'ms':>8} {'x 1 row':>8}")
    for n, ms in rows:
        print(f"{n:>5} {ms:>8.1f} {ms / base:>8.2f}")
    return rows


def bandwidth_gbs(reps: int = 7, mib: int = 512) -> float:
    """Memory bandwidth a plain torch reduction reaches over `mib` MiB (median of reps)."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def step_split(engine, prompt, n: int, reps: int) -> dict:
    """ms of one n-row verify step and of its parts, each timed alone in interleaved rounds
    (medians): every weight's product (the layout's own), the attention over all layers
    (the engine's backend), and the rest (norms, RoPE, KV writes, residual adds, argmax,
    host/Python: the step minus the two)."""
    layout, v = engine.layout, engine.view
    linears = [lin for lw in v.layers for lin in (lw.q, lw.k, lw.v, lw.o, lw.gate, lw.up, lw.down)]
    weights = [lin.weight for lin in linears] + [v.lm_head.weight]
    rows = layout.rows(n)
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(w.dtype) for w in weights}
    q = torch.randn(v.num_heads, n, v.head_dim).to(v.dtype)
    context = len(prompt)

    def step():
        meta = engine.make_meta(range(context, context + n))
        engine.verify(engine.embed(prompt[:n]), 0, meta, logits=False)

    # the products as the step reads them: the compact forms of a model dequantized from
    # GGUF Q4_1 (engine/compact.py), else the layout's own products of the weights
    compact = getattr(engine, "compact", None)
    if compact is not None:
        from hf_selfspec.kernels.cpu_rows import load_rows_linear

        from hf_selfspec.engine.compact import projection_positions

        rows_linear, forms = load_rows_linear(), compact.kernel_weights
        read = [forms[i] for i in projection_positions(len(forms), engine.fused_per_layer)]
        columns = [lin.weight.shape[1] for lin in linears]

    def products():
        if compact is not None:
            for k, w in zip(columns, read):
                rows_linear(xs[k], w)
        else:
            for lin in linears:
                layout.linear(xs[lin.weight.shape[1]], lin)
        if engine.screen is not None:  # the LM head as a greedy step reads it
            engine.screen.argmax(xs[v.lm_head.weight.shape[1]])
        else:
            layout.linear(xs[v.lm_head.weight.shape[1]], v.lm_head)

    def attention():
        attend = engine.attention.bind(engine, engine.make_meta(range(context, context + n)))
        for layer in range(v.num_layers):
            attend(q, layer)

    parts = {"step": step, "products": products, "attention": attention}
    samples = {k: [] for k in parts}
    for _ in range(reps):
        for k, fn in parts.items():
            t0 = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - t0)
    ms = {k: statistics.median(t) * 1e3 for k, t in samples.items()}
    ms["rest"] = max(0.0, ms["step"] - ms["products"] - ms["attention"])
    return ms


def roofline(model, prompt, widths=(1, 4, 8), reps: int = 9):
    """Bytes one engine step reads (weights + KV after `prompt`) over the measured bandwidth,
    beside the step's measured time: how far each step is from the memory bound; and where
    each step's time goes (step_split)."""
    context = len(prompt)
    engine = selfspec_state(model).engine_for(model, 1024)
    cfg = model.config
    params = {p.data_ptr(): p for p in model.parameters()}.values()  # tied weights once
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    embed = model.get_input_embeddings().weight
    if embed.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        weight_bytes -= embed.numel() * embed.element_size()  # a step reads one embedding row
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * context * embed.element_size()
    gbs = bandwidth_gbs()
    bound_ms = (weight_bytes + kv_bytes) / (gbs * 1e9) * 1e3
    # a greedy step reads the LM head through its int8 screen (engine/screen.py): a quarter of its bytes
    head = model.get_output_embeddings().weight
    screened = weight_bytes - (head.numel() * head.element_size() - engine.screen.copy_bytes
                               if engine.screen is not None else 0)
    # ... and the projections held as exact GGUF blocks through their compact forms
    compact = getattr(engine, "compact", None)
    screened -= 0 if compact is None else compact.read_bytes_saved
    screened_ms = (screened + kv_bytes) / (gbs * 1e9) * 1e3
    engine.prefill(prompt)
    rows = []
    for n in widths:
        if n <= engine.width:
            ms = verify_ms(engine, prompt, n, reps)
            with_logits = verify_ms(engine, prompt, n, reps, logits=True)
            split = step_split(engine, prompt, n, reps)
            rows.append({"rows": n, "ms": ms, "ms_with_logits": with_logits, "bound_ms": bound_ms,
                         "of_bound": bound_ms / ms, "read_bound_ms": screened_ms, "split": split})
    print(f"\nRoofline: {weight_bytes / 1e6:.0f} MB weights + {kv_bytes / 1e6:.1f} MB KV at {context} "
          f"tokens per step; bandwidth {gbs:.1f} GB/s (torch sum over 512 MiB) -> bound {bound_ms:.1f} ms "
          f"({1e3 / bound_ms:.0f} AR steps/s); a greedy step reads {screened / 1e6:.0f} MB of weights "
          f"(the LM head's int8 screen: {engine.screen is not None}; projections read as exact GGUF "
          f"blocks: {0 if compact is None else compact.count}) -> {screened_ms:.1f} ms")
    print(f"{'rows':>5} {'ms':>8} {'w/ logits':>10} {'bound ms':>9} {'% of bound':>11} {'% of read':>10}   "
          "split of a greedy step, timed apart: products / attention / rest (norms, RoPE, KV write, adds, "
          "argmax, host)")
    for r in rows:
        sp = r["split"]
        parts = f"{sp['products']:.1f} / {sp['attention']:.1f} / {sp['rest']:.1f} ms of {sp['step']:.1f}"
        print(f"{r['rows']:>5} {r['ms']:>8.1f} {r['ms_with_logits']:>10.1f} {r['bound_ms']:>9.1f} "
              f"{r['of_bound']:>10.0%} {r['read_bound_ms'] / r['ms']:>10.0%}   {parts}")
    return {"weight_bytes": weight_bytes, "greedy_step_weight_bytes": screened, "kv_bytes": kv_bytes,
            "bandwidth_gbs": gbs, "steps": rows}


@torch.no_grad()
def off_the_gguf_grid(model, scale: float = 1e-3, seed: int = 0) -> None:
    """Every 2-D decoder weight plus Gaussian noise of `scale` x its std, rounded to bfloat16
    values (kept in the model's dtype), in place: the model an ordinary bf16 checkpoint
    loaded in float32 is, whose matrices hold no GGUF blocks (the engine's compact reads,
    compact.py, find none)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.model.layers.parameters():
        if p.dim() == 2:
            p.add_(torch.randn(p.shape, generator=gen) * float(p.std()) * scale)
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def main(argv=None):
    # run as `hf-selfspec bench` (cli.py names itself in HF_SELFSPEC_PROG): usage and examples
    # in the command the user typed
    prog = os.environ.get("HF_SELFSPEC_PROG")
    doc = __doc__.replace("python scripts/bench.py", prog.ljust(len("python scripts/bench.py"))) if prog else __doc__
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--categories", default="chat,code,summarize,adversarial",
                    help="comma-separated prompt_sets categories; also qa, math, translate "
                         "(e.g. chat,qa,math,translate,summarize: issue 29's held-out kind of mix)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--early-exit-layer", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--widths", action="store_true", help="also print the step cost vs rows")
    ap.add_argument("--roofline", action="store_true",
                    help="also print bytes per step over measured bandwidth (the memory bound)")
    ap.add_argument("--heads", default=None, help="heads folder (default: shipped heads)")
    ap.add_argument("--model", default=None,
                    help="HF model folder or id instead of the embedded default (heads: --heads, else none)")
    ap.add_argument("--ordinary", action="store_true",
                    help="run the model off the GGUF grid, as an ordinary checkpoint: every decoder "
                         "projection jittered by 1e-3 of its std and rounded to bfloat16 values (kept "
                         "float32), so no matrix holds GGUF blocks and compact reads cannot apply")
    ap.add_argument("--draft-model", default=None,
                    help="a smaller HF model of the same tokenizer: adds hf_assisted and self_draft_model")
    ap.add_argument("--out", default=None,
                    help="save the records here as JSON and the plot beside it (.png), e.g. "
                         "docs/bench.json; without it nothing is written")
    ap.add_argument("--report", default=None,
                    help="also write a markdown report here (e.g. docs/benchmarks.md); needs --out")
    args = ap.parse_args(argv)
    if args.report and not args.out:  # before the model loads: the report shows the --out plot
        ap.error("--report needs --out (the report shows the plot saved beside the --out JSON)")
    torch.set_num_threads(args.threads)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.draft_model:
        methods += [m for m in DRAFT_METHODS if m not in methods]
    for m in methods:
        known = METHODS + DRAFT_METHODS + TREE_METHODS + PEER_METHODS + SAMPLE_METHODS
        if m not in known:
            ap.error(f"unknown method {m!r}; choose from {known}")
        if m in PEER_METHODS and (args.model or importlib.util.find_spec("llama_cpp") is None):
            ap.error(f"method {m} needs llama-cpp-python (pip install llama-cpp-python) and the default model")
        if m in DRAFT_METHODS and not args.draft_model:
            ap.error(f"method {m} needs --draft-model")

    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32").eval()
    else:
        model, tokenizer = load_default_model_and_tokenizer()
    if args.ordinary:
        off_the_gguf_grid(model)
    heads = args.heads if args.heads or not args.model else False
    try:
        attach_heads(model, heads)
    except FileNotFoundError:
        print("no shipped heads found: self-spec runs with prompt lookup only")
        heads = False
        attach_heads(model, False)
    if heads is False:
        methods = [m for m in methods if not m.startswith("self_heads")]
    draft_model = None
    if args.draft_model:
        from transformers import AutoModelForCausalLM

        draft_model = AutoModelForCausalLM.from_pretrained(args.draft_model, dtype="float32").eval()
    attached = selfspec_state(model).decode_config
    state = {"eos": [tokenizer.eos_token_id], "early_exit_layer": args.early_exit_layer,
             "draft_model": draft_model, "seed": 0,
             "decode": {k: dataclasses.replace(attached, **v) for k, v in SELF_DECODE.items()}}
    peers = [m for m in methods if m in PEER_METHODS]
    if peers:
        from llama_cpp_peer import LlamaCppPeer, f32_gguf

        path = f32_gguf()
        state["peers"] = {m: LlamaCppPeer(path, args.threads, lookup_tokens=10 if m == "llama_cpp_lookup" else 0)
                          for m in peers}
    sets = prompt_sets(tokenizer, per_category=args.per_category)
    categories = [c for c in args.categories.split(",") if c]
    unknown = sorted(set(categories) - set(sets))
    if unknown or not categories:
        ap.error(f"--categories: unknown {unknown or 'none given'}; choose from {', '.join(sets)}")

    # warm-up, untimed: every method once on a short prompt, so no method pays the process's
    # first-call costs (allocator, thread pool, engine build) inside a timed run
    warm = torch.tensor([render_prompt(tokenizer, sets[categories[0]][0])])
    for m in methods:
        run_method(m, model, warm, 8, state)

    records = []
    for cat in categories:
        for i, messages in enumerate(sets[cat][: args.per_category]):
            ids = torch.tensor([render_prompt(tokenizer, messages)])
            order = methods[i % len(methods):] + methods[: i % len(methods)]  # rotate
            outs = {}
            state["seed"] = 1000 * categories.index(cat) + i  # one seed per prompt, the same for every method
            for m in order:
                tokens, seconds, stats = run_method(m, model, ids, args.max_new_tokens, state)
                outs[m] = (tokens, seconds, stats)
            ref = outs.get("hf_greedy", (None,))[0]
            for m, (tokens, seconds, stats) in outs.items():
                records.append({"category": cat, "prompt": i, "method": m, "prompt_tokens": ids.shape[1],
                                "new_tokens": len(tokens), "seconds": seconds,
                                "identical": None if ref is None or m in SAMPLE_METHODS else tokens == ref,
                                "stats": stats})
            line = " ".join(f"{m}={len(t) / s:.1f}" for m, (t, s, _) in outs.items())
            print(f"[{cat} {i}] prompt {ids.shape[1]} tok | tok/s {line}", flush=True)

    print_table(records, categories, methods)
    widths = width_curve(model, [1, 2, 3, 4, 6, 8], text_context(tokenizer, sets, 200)) if args.widths else None
    bound = roofline(model, text_context(tokenizer, sets, 300)) if args.roofline else None
    engine = selfspec_state(model).engine
    compact = None if engine is None or engine.compact is None else engine.compact.count
    print(f"\nweights: {'ordinary checkpoint (off the GGUF grid)' if args.ordinary else 'as loaded'}; "
          f"projections read compactly: {compact or 0}")
    if not args.out:
        print("\nnothing saved: pass --out FILE.json to keep the records and the plot")
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
            "torch": torch.__version__, "max_new_tokens": args.max_new_tokens, "ordinary": args.ordinary,
            "compact_projections": compact or 0,
            "engine_layout": selfspec_state(model).engine.layout.name if selfspec_state(model).engine else None}
    out.write_text(json.dumps({"meta": meta, "records": records, "width_curve": widths, "roofline": bound},
                              indent=1))
    print(f"\nsaved {out}")
    png = out.with_suffix(".png")
    plot(records, categories, methods, png)
    if args.report:
        write_report(Path(args.report), records, categories, methods, meta, widths, png, argv)


def summarize(records, cat, method):
    rows = [r for r in records if r["method"] == method and (cat == "all" or r["category"] == cat)]
    if not rows:
        return None
    ref = [r for r in records if r["method"] == "hf_greedy" and (cat == "all" or r["category"] == cat)]
    tokens = sum(r["new_tokens"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    ratio = (sum(r["seconds"] for r in ref) / sum(r["new_tokens"] for r in ref)) / (secs / tokens) if ref else None
    stats = [r["stats"] for r in rows if r["stats"]]
    tau = sum(s["new_tokens"] for s in stats) / max(sum(s["cycles"] for s in stats), 1) if stats else None
    identical = sum(bool(r["identical"]) for r in rows)
    split = None
    if stats:
        total = sum(s["total_time"] for s in stats)
        split = {k: sum(s[k] for s in stats) / total
                 for k in ("prefill_time", "draft_time", "verify_time", "host_time")}
    same = "-" if all(r["identical"] is None for r in rows) else f"{identical}/{len(rows)}"
    return {"tok_s": statistics.median(r["new_tokens"] / r["seconds"] for r in rows), "ratio": ratio,
            "tau": tau, "identical": same, "split": split}


def sampling_ratio(records, cat) -> float | None:
    """Time per token of hf_sample over self_sample's in `cat` ("all": every category)."""
    per = {}
    for m in SAMPLE_METHODS:
        rows = [r for r in records if r["method"] == m and (cat == "all" or r["category"] == cat)]
        if not rows:
            return None
        per[m] = sum(r["seconds"] for r in rows) / max(sum(r["new_tokens"] for r in rows), 1)
    return per["hf_sample"] / per["self_sample"]


def print_table(records, categories, methods):
    for cat in categories + ["all"]:
        print(f"\n== {cat} ==")
        print(f"{'method':<18}{'tok/s':>7}{'x HF':>7}{'tau':>6}{'same':>7}   time: prefill/draft/verify/host")
        for m in methods:
            s = summarize(records, cat, m)
            if s is None:
                continue
            ratio = f"{s['ratio']:.2f}" if s["ratio"] else "-"
            tau = f"{s['tau']:.2f}" if s["tau"] else "-"
            split = " / ".join(f"{v:.0%}" for v in s["split"].values()) if s["split"] else ""
            print(f"{m:<18}{s['tok_s']:>7.1f}{ratio:>7}{tau:>6}{s['identical']:>7}   {split}")
        sampled = sampling_ratio(records, cat)
        if sampled is not None:
            print(f"self_sample is {sampled:.2f}x hf_sample (time per token; T 0.7, top-p 0.9)")


def write_report(path, records, categories, methods, meta, widths, png, argv):
    """docs/benchmarks.md: the tables of print_table, the machine, the command."""
    import os

    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    lines = ["# Benchmarks", "",
             f"Machine: {cpu}, {os.cpu_count()} cores, torch {meta['torch']} (CPU), "
             f"{meta['machine'].split(', ')[-1]}; model SmolLM2-135M-Instruct fp32; "
             f"{meta['max_new_tokens']} new tokens per prompt; engine row layout: {meta['engine_layout']}.",
             "", "Reproduce: `python scripts/bench.py " + " ".join(argv or sys.argv[1:]) + "`", "",
             "All methods run on each prompt side by side in one process (order rotated per prompt). "
             "`x HF` = HF greedy time per token / the method's time per token over the category; "
             "`tau` = tokens committed per verification; `same` = outputs identical to HF greedy; "
             "time split of self-spec = prefill / drafting / verification / host.", ""]
    for cat in categories + ["all"]:
        lines += [f"## {cat}", "",
                  "| method | tok/s (median) | x HF greedy | tau | identical | prefill / draft / verify / host |",
                  "|---|---|---|---|---|---|"]
        for m in methods:
            s = summarize(records, cat, m)
            if s is None:
                continue
            split = " / ".join(f"{v:.0%}" for v in s["split"].values()) if s["split"] else ""
            tau = "" if s["tau"] is None else f"{s['tau']:.2f}"
            lines.append(f"| {m} | {s['tok_s']:.1f} | {s['ratio']:.2f} | {tau} | {s['identical']} | {split} |")
        lines.append("")
    if widths:
        lines += ["## Step cost vs rows", "", "| rows | ms | x 1 row |", "|---|---|---|"]
        lines += [f"| {n} | {ms:.1f} | {ms / widths[0][1]:.2f} |" for n, ms in widths]
        lines.append("")
    if png.exists():
        lines += [f"![speed vs HF greedy]({os.path.relpath(png, path.parent)})", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print(f"saved {path}")


def plot(records, categories, methods, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        vals = [(summarize(records, c, m) or {}).get("ratio") or 0 for c in categories + ["all"]]
        ax.bar([i + j * width for i in range(len(vals))], vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(categories) + 1)], categories + ["all"])
    ax.set_ylabel("speed vs HF greedy (x)")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
