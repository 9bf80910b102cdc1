"""GPU check: AR step time of the engine (eager and CUDA graphs) vs HF greedy generate().

Builds a random-weight Llama-style model on the GPU (no network, no download), then prints

  1. ms per new token of: HF greedy generate(), the engine's AR loop eager, the same loop
     through CUDA graphs, the bare replay of the `ar` graph (GPU time, no host work), and
     lookup-only speculative decoding through the graphs, each against the HBM bound
     (bytes of weights read per step / bandwidth);
  2. where the GPU time of one `ar` graph replay goes: kernels grouped by name
     (torch.profiler, CUDA activity), launches and microseconds per step;
  3. the GPU time of a `verify` graph replay at each engine width W of --width-sweep (all W
     rows real), against W = 1: what a wider verification costs here;
  4. token parity on a few random prompts: graphs == eager and speculative == AR (the
     engine's invariants: must be 100%), engine AR == HF greedy (a measured rate; random
     weights give near-flat logits, so near-ties make early divergence likely in bf16);
  5. draft trees on the Triton path: random top-layer heads with siblings (mostly wrong,
     so rows off the chain get verified and sometimes accepted), tree decoding eager and
     through CUDA graphs == the engine's AR tokens on every prompt, and how many cycles
     accepted a row off the chain (0 would mean the check did not exercise trees);
  6. generate(..., assistant="self") on the model (no heads: prompt lookup) with the graph
     executor: tokens == engine AR and ms per token beside HF greedy.
  7. with --replay-only (its own phase in gpu_check.sh): the decode traces recorded on the
     CPU with the real default model and its shipped heads (scripts/record_traces.py,
     scripts/data/) replayed cycle by cycle through the engine's executor on random-weight
     models of the default model's shape and of the 1B-class shape above: the recorded rows
     (chain or tree) verified in one step at the recorded position, the heads drafting as
     deep as they did, the accepted path compacted; predicted tokens/s = committed tokens /
     replay time, beside HF greedy, HF prompt lookup and HF assisted generation (a random
     2-layer draft model) measured on the same model.
  8. the fused small kernels (opt-in Engine.fused_small_ops: residual add + RMSNorm, RoPE +
     KV write in Triton): graphs == eager and speculative == AR with them, their tokens and
     logits against the unfused engine, the `ar` graph's GPU time with and without them.
Batched steps (several sequences' KV regions) are checked at the kernel level by
tests/test_triton_trees.py (scripts/gpu_check.sh runs it); the fixed layout the GPU uses
does not take steps wider than its width yet.

Exit status 1 when an invariant fails or a CUDA-graph capture fell back to eager.
Per-token times are (t(N new) - t(1 new)) / (N - 1): the prefill cancels out. Run by
scripts/gpu_check.sh; see docs/gpu.md.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

DEVICE = "cuda"  # a module constant so that a CPU dry run of the plumbing can swap it
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "traces_smollm2.json.gz"
# Random-weight models the traces are replayed on: the default model's shape (the traces'
# own) and "main", the --hidden/--layers/... model of the other sections (1B class).
REPLAY_SHAPES = {
    "smollm2-135m": {"hidden": 576, "layers": 30, "heads": 9, "kv_heads": 3, "intermediate": 1536,
                     "vocab": 49152, "tie": True},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--bandwidth", type=float, default=4.8e12,
                   help="HBM bandwidth in bytes/s for the bound (H200: 4.8e12, H100 SXM: 3.35e12)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size")
    p.add_argument("--layers", type=int, default=16, help="decoder layers")
    p.add_argument("--heads", type=int, default=32, help="query heads (head_dim = hidden / heads, a power of two)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    p.add_argument("--intermediate", type=int, default=8192, help="MLP size")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="weights and activations")
    p.add_argument("--width", type=int, default=8, help="engine width W (rows per step)")
    p.add_argument("--capacity", type=int, default=1024, help="engine KV capacity")
    p.add_argument("--prompts", type=int, default=3, help="random prompts for the parity table")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per random prompt")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per generation (N)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (median)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--width-sweep", default="1,2,4,8,16,32",
                   help="engine widths W whose `verify` graph replay is timed (what a wider "
                        "verification costs on this GPU; empty: none)")
    p.add_argument("--profile-steps", type=int, default=16,
                   help="replays of the `ar` graph under torch.profiler for the kernel table (0: none)")
    replay = p.add_argument_group("replayed traces (--replay-only; docs/gpu.md)")
    replay.add_argument("--replay-only", action="store_true",
                        help="only replay the recorded decode traces (scripts/record_traces.py) on "
                             "random-weight models of --replay-shapes, against HF decoding")
    replay.add_argument("--replay-trace", default=str(DEFAULT_TRACE), help="recorded traces (.json[.gz])")
    replay.add_argument("--replay-shapes", default="smollm2-135m,main",
                        help=f"model shapes: {', '.join(REPLAY_SHAPES)}, or main (--hidden, --layers, ...)")
    replay.add_argument("--replay-prompts", type=int, default=0, help="prompts replayed per trace (0: all)")
    replay.add_argument("--replay-hf-new", type=int, default=32,
                        help="new tokens N of the per-token HF and engine-AR timings")
    replay.add_argument("--replay-budget", type=float, default=150.0,
                        help="seconds for the whole replay: what does not fit is skipped and said so")
    return p.parse_args(argv)


def build_model(args, torch):
    """Random-weight LlamaForCausalLM, initialised on the GPU (fast), in the chosen dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=max(4096, args.capacity),
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(args.seed)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config)
    model = model.to({"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]).eval()
    # no EOS: every generate() runs its full length, so the per-token times compare
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def bytes_per_step(model, args, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one AR step reads at least: every layer weight, the final
    norm and the LM head once, one embedding row; K and V of `context` positions."""
    layers = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    lm_head = model.lm_head.weight
    element = lm_head.element_size()
    weights = (layers + model.model.norm.weight.numel() * element
               + lm_head.numel() * element + args.hidden * element)
    head_dim = args.hidden // args.heads
    kv = 2 * args.layers * args.kv_heads * context * head_dim * element
    return weights, kv


def print_kernel_table(runner, engine, prompt, steps: int, torch) -> None:
    """Kernels of `steps` back-to-back `ar` graph replays (torch.profiler, CUDA activity),
    grouped by name: launches and GPU microseconds per step, most expensive first."""
    from torch.profiler import ProfilerActivity, profile

    program = runner.program(("ar",))
    if program is None:
        print("\n## kernels per `ar` step: no `ar` graph captured")
        return
    engine.prefill(prompt)
    engine.make_meta([len(prompt)])
    program.graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            program.graph.replay()
        torch.cuda.synchronize()
    def device_us(event) -> float:  # torch >= 2.4 names it device_time_total
        return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)

    events = [e for e in prof.key_averages() if device_us(e) > 0]
    total = sum(device_us(e) for e in events)
    launches = sum(e.count for e in events)
    print(f"\n## kernels per `ar` step (torch.profiler over {steps} graph replays): "
          f"{launches / steps:.0f} launches, {total / steps:.0f} us of kernel time")
    print("| kernel | launches / step | us / step | share |")
    print("|---|---|---|---|")
    events.sort(key=lambda e: -device_us(e))
    for e in events[:15]:
        t = device_us(e)
        print(f"| `{e.key[:70]}` | {e.count / steps:.0f} | {t / steps:.1f} | {t / total:.0%} |")


def print_width_sweep(model, args, prompt, torch) -> None:
    """GPU time of one `verify` graph replay (all layers, all W rows real) per engine width."""
    from hf_selfspec.engine.core import Engine, EngineConfig
    from hf_selfspec.engine.cuda_graphs import CudaGraphRunner

    widths = [int(w) for w in args.width_sweep.split(",") if w.strip()]
    if not widths:
        return
    print(f"\n## `verify` graph replay per engine width (context {len(prompt)}, all rows real)")
    print("| W | ms / replay | x W = 1 | ms per row |")
    print("|---|---|---|---|")
    first = None
    for width in widths:
        engine = Engine(model, EngineConfig(width=width, capacity=args.capacity, row_layout="fixed"))
        runner = CudaGraphRunner(engine)
        runner.warmup([("verify", 0)])
        program = runner.program(("verify", 0))
        if program is None:
            print(f"| {width} | capture failed: {runner.fallback_reason} | - | - |")
            continue
        engine.prefill(prompt)
        engine.make_meta(list(range(len(prompt), len(prompt) + width)))
        for _ in range(3):
            program.graph.replay()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 50
        begin.record()
        for _ in range(reps):
            program.graph.replay()
        end.record()
        torch.cuda.synchronize()
        ms = begin.elapsed_time(end) / reps
        first = first or ms
        print(f"| {width} | {ms:.3f} | {ms / first:.2f} | {ms / width:.3f} |")
        del runner, engine
        torch.cuda.empty_cache()


def check_trees(model, engine, graph_engine, prompts, N, torch, failed) -> None:
    """Section 5: tree decoding, eager and through graphs, == the engine's AR tokens."""
    from hf_selfspec.decoding.cycle import DecodeConfig, SelfSpecDecoder
    from hf_selfspec.heads.top import random_top_heads  # confident, mostly wrong: trees branch

    top = random_top_heads(model, depth=3)
    config = DecodeConfig(thresholds=0.0, lookup="first", tree="on", siblings=3,
                          sibling_min_prob=0.0, adaptive=False)
    print(f"\n## draft trees on the Triton path (random top heads, siblings 3; {N} new)")
    print("| prompt | eager trees == AR | graph trees == AR | cycles | off-chain cycles | drafted / accepted |")
    print("|---|---|---|---|---|---|")
    off_chain = 0
    for i, prompt in enumerate(prompts):
        reference = engine.generate_ar(prompt, N)
        eager = SelfSpecDecoder(engine, top, config).generate(prompt, N)
        graphs = SelfSpecDecoder(graph_engine, top, config).generate(prompt, N)
        off_chain += graphs.stats.off_chain_cycles
        print(f"| {i} | {eager.tokens == reference} | {graphs.tokens == reference} | "
              f"{graphs.stats.cycles} | {graphs.stats.off_chain_cycles} | "
              f"{graphs.stats.drafted} / {graphs.stats.accepted} |")
        if eager.tokens != reference:
            failed.append(f"prompt {i}: eager tree tokens != AR tokens")
        if graphs.tokens != reference:
            failed.append(f"prompt {i}: graph tree tokens != AR tokens")
    if graph_engine.graphs.eager:
        failed.append(f"tree engine's capture fell back: {graph_engine.graphs.fallback_reason}")
    # the heads' drafting: one host sync per cycle (the default on CUDA) against a decision
    # on the host after every head step
    print("\n| heads' drafting | draft ms / cycle | == AR |")
    print("|---|---|---|")
    for one_sync in (True, False):
        decoder = SelfSpecDecoder(graph_engine, top, config)
        decoder.drafter.one_sync = one_sync
        runs = [decoder.generate(prompt, N) for prompt in prompts]
        same = all(r.tokens == engine.generate_ar(p, N) for r, p in zip(runs, prompts))
        per_cycle = 1e3 * sum(r.stats.draft_time for r in runs) / max(1, sum(r.stats.cycles for r in runs))
        print(f"| {'one sync' if one_sync else 'sync per step'} | {per_cycle:.3f} | {same} |")
        if not same:
            failed.append(f"trees with {'one-sync' if one_sync else 'per-step'} drafting != AR tokens")
    if off_chain == 0:
        print("(no cycle accepted a row off the chain: trees were verified, but no branch was taken)")


def ar_replay_ms(engine, program, prompt, replays: int, torch) -> float:
    """GPU time of one replay of the captured `ar` program (no host work between replays),
    in ms, after prefilling `prompt` (one warm replay first)."""
    engine.prefill(prompt)
    engine.make_meta([len(prompt)])
    program.graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        program.graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / replays


def check_fused(model, engine, args, prompts, N, torch, failed) -> None:
    """Section 8: the fused small kernels (Engine.fused_small_ops, kernels/fused.py) on this
    GPU: a fused engine's AR through graphs == its eager AR and its speculative tokens ==
    its AR (invariants), its tokens against the unfused engine's (a measured rate: RMSNorm
    rounds differently), the logits' largest difference, and the `ar` graph's GPU time."""
    from hf_selfspec.decoding.cycle import DecodeConfig, SelfSpecDecoder
    from hf_selfspec.engine.core import Engine, EngineConfig

    config = EngineConfig(width=args.width, capacity=args.capacity, row_layout="fixed")
    fused = Engine(model, config)
    fused.fused_small_ops = True
    fused_graphs = Engine(model, EngineConfig(width=args.width, capacity=args.capacity, row_layout="fixed",
                                              executor="cuda_graphs"))
    fused_graphs.fused_small_ops = True
    print(f"\n## fused small kernels (add + RMSNorm, RoPE + KV write; {N} new)")
    print("| prompt | graphs == eager (fused) | spec == AR (fused) | fused == unfused tokens | max |logit diff| |")
    print("|---|---|---|---|---|")
    for i, prompt in enumerate(prompts):
        eager = fused.generate_ar(prompt, N)
        graphs = fused_graphs.generate_ar(prompt, N)
        spec = SelfSpecDecoder(fused_graphs, None, DecodeConfig(lookup="only")).generate(prompt, N).tokens
        unfused = engine.generate_ar(prompt, N)
        diffs = []
        for e in (fused, engine):
            e.prefill(prompt)
            meta = e.make_meta(range(len(prompt), len(prompt) + args.width))
            diffs.append(e.verify(e.embed(prompt[:args.width]), 0, meta)[0].float())
        diff = float((diffs[0] - diffs[1]).abs().max())
        print(f"| {i} | {graphs == eager} | {spec == eager} | {unfused == eager} | {diff:.3g} |")
        if graphs != eager:
            failed.append(f"prompt {i}: fused graph AR tokens != fused eager AR tokens")
        if spec != eager:
            failed.append(f"prompt {i}: fused speculative tokens != fused AR tokens")
    if fused_graphs.graphs.eager:
        failed.append(f"fused engine's capture fell back: {fused_graphs.graphs.fallback_reason}")
    prompt = prompts[0]
    times = []
    for e in (engine, fused_graphs):
        runner = e.graphs
        if runner is None:
            from hf_selfspec.engine.cuda_graphs import CudaGraphRunner

            runner = CudaGraphRunner(e)
        runner.warmup([("ar",)])
        times.append(ar_replay_ms(e, runner.program(("ar",)), prompt, N, torch))
    print(f"`ar` graph replay (GPU time): unfused {times[0]:.3f} ms, fused {times[1]:.3f} ms "
          f"({times[0] / times[1]:.2f}x)")


# ---- replayed traces: what the recorded decodes of the real default model would cost here ----


def sync(torch) -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def shaped_model(shape: dict, dtype: str, seed: int, capacity: int, torch):
    """Random-weight LlamaForCausalLM of `shape` (REPLAY_SHAPES' keys) on DEVICE."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=max(4096, capacity),
        tie_word_embeddings=shape.get("tie", False), bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config)
    model = model.to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]).eval()
    model.generation_config.eos_token_id = None  # every generate() runs its full length
    model.generation_config.pad_token_id = 0
    return model


def replay_shapes(args) -> dict[str, dict]:
    main_shape = {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                  "intermediate": args.intermediate, "vocab": args.vocab, "tie": False}
    shapes = {}
    for name in (n.strip() for n in args.replay_shapes.split(",") if n.strip()):
        if name == "main":
            shapes[f"main ({args.hidden}x{args.layers})"] = main_shape
        elif name in REPLAY_SHAPES:
            shapes[name] = REPLAY_SHAPES[name]
        else:
            raise SystemExit(f"--replay-shapes: unknown shape {name!r} (known: {', '.join(REPLAY_SHAPES)}, main)")
    return shapes


def replay_engine(model, width: int, capacity: int):
    """The engine the replay runs: the fixed layout with the executor generate() gives a
    model on DEVICE (CUDA graphs on CUDA, eager elsewhere)."""
    from hf_selfspec.engine.core import Engine, EngineConfig

    executor = "cuda_graphs" if DEVICE == "cuda" else "eager"
    return Engine(model, EngineConfig(width=width, capacity=capacity, row_layout="fixed", executor=executor))


def random_draft_heads(model, seed: int, torch):
    """Top-layer draft heads of the shipped heads' shape (depth, adapter, reduced vocabulary:
    hf_selfspec/default_heads/config.json) with random weights, bound to `model`: they
    cost what the shipped heads cost per drafting step."""
    import json

    from hf_selfspec.heads.base import fingerprint
    from hf_selfspec.heads.top import TopDraftHeads, TopHeadsConfig

    shipped = json.loads((Path(__file__).resolve().parent.parent / "hf_selfspec" / "default_heads"
                          / "config.json").read_text())
    cfg = model.config
    reduced = min(shipped["reduced_vocab"], cfg.vocab_size)
    config = TopHeadsConfig(base_model="random", base_fingerprint=fingerprint(model),
                            num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                            vocab_size=cfg.vocab_size, depth=shipped["depth"],
                            adapter_dim=shipped["adapter_dim"], reduced_vocab=reduced)
    heads = TopDraftHeads(config, torch.arange(reduced))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for step in heads.steps:
            for p in (step.down.weight, step.up.weight):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return heads.init_from_model(model)


def replay_trace(engine, drafter, prompts: list[dict], tree_mode: bool, seed: int, torch) -> dict:
    """Replay recorded cycles (scripts/record_traces.py) on `engine`: per prompt a random
    prompt of the recorded length is prefilled (not timed), then per cycle what the decode
    loop does, at the recorded position: the heads draft (when they did, as deep as they
    did; thresholds 0, so they do their most work), the recorded rows (a chain, or the tree
    with its parents) are embedded and verified in ONE engine step, the argmax comes to the
    host, the accepted path's KV is compacted. Token values are random: the cost of a step
    does not depend on them. -> seconds of the cycles (prefill excluded), committed tokens,
    rows of every step, cycles."""
    import random

    from hf_selfspec.decoding.candidates import DraftContext

    rng = random.Random(seed)
    vocab = engine.view.vocab_size
    seconds, committed, rows_seen, cycles = 0.0, 0, [], 0
    for entry in prompts:
        prompt = [rng.randrange(3, vocab) for _ in range(entry["prompt_tokens"])]
        _, final = engine.prefill(prompt)
        plan = []  # what the loop knows before it verifies: host lists, made before the clock
        for position, n, done, budget, parents, accepted in entry["cycles"]:
            parents = parents if parents is not None else list(range(-1, n - 1))
            if len(parents) != n or not 1 <= n <= engine.width:
                raise ValueError(f"a recorded cycle of {n} rows does not fit this engine (width {engine.width})")
            depth = [0] * n
            for i in range(1, n):
                depth[i] = depth[parents[i]] + 1
            plan.append((position, n, done, budget, parents, depth, accepted,
                         [rng.randrange(3, vocab) for _ in range(n)]))
        sync(torch)
        start = time.perf_counter()
        for position, n, done, budget, parents, depth, accepted, tokens in plan:
            if budget and drafter is not None:
                ctx = DraftContext([tokens[0]], final, position, frozenset(), tree_mode)
                drafter.propose(ctx, budget)
            if depth[-1] == n - 1:  # a chain
                rows = engine.step_rows(range(position, position + n))
            else:
                paths = []
                for i in range(n):
                    path, r = [], i
                    while r >= 0:
                        path.append(position + r)
                        r = parents[r]
                    paths.append(path[::-1])
                rows = engine.step_rows([position + d for d in depth], [position + i for i in range(n)], paths)
            _, argmax, finals = engine.verify(engine.embed(tokens), 0, engine.rows_meta(rows))
            argmax.tolist()  # the host's acceptance decision: one sync per cycle
            engine.move_kv([position + r for r in accepted[1:]],
                           [position + 1 + j for j in range(len(accepted) - 1)])
            final = finals[accepted[-1]]
            rows_seen.append(n)
            committed += done
            cycles += 1
        sync(torch)
        seconds += time.perf_counter() - start
    return {"seconds": seconds, "committed": committed, "rows": rows_seen, "cycles": cycles}


def per_token_ms(run, prompt, new: int, torch, repeats: int = 1) -> float:
    """Median over repeats of (t(new) - t(1)) / (new - 1), in ms (the prefill cancels)."""
    run(prompt, new)  # warm-up
    samples = []
    for _ in range(repeats):
        times = []
        for n in (1, new):
            sync(torch)
            start = time.perf_counter()
            run(prompt, n)
            sync(torch)
            times.append(time.perf_counter() - start)
        samples.append((times[1] - times[0]) / (new - 1) * 1e3)
    return statistics.median(samples)


def replay_model(name: str, shape: dict, data: dict, args, deadline: float, torch, failed: list) -> list:
    """One model shape: the traces replayed through the engine's executor beside HF greedy,
    HF prompt lookup and HF assisted generation on the same model. -> table rows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_selfspec.decoding.drafters import TopHeadsDrafter

    traces = {k: v[: args.replay_prompts or None] for k, v in data["traces"].items()}
    entries = [e for t in traces.values() for e in t]
    longest = max(e["prompt_tokens"] + e["new_tokens"] for e in entries)
    width = data["width"]
    capacity = -(-(longest + 2 * width) // 256) * 256
    t0 = time.perf_counter()
    model = shaped_model(shape, args.dtype, args.seed, capacity, torch)
    engine = replay_engine(model, width, capacity)
    cfg = data["decode_config"]
    heads = random_draft_heads(model, args.seed, torch)
    drafter = TopHeadsDrafter(heads, [0.0] * heads.config.depth, cfg["siblings"] + 1, cfg["tree_beam"], 0.0)
    params = sum(p.numel() for p in model.parameters())
    print(f"\n## replayed traces on {name}: {params / 1e9:.3f}B params, hidden {shape['hidden']}, "
          f"{shape['layers']} layers, {shape['heads']}/{shape['kv_heads']} heads, vocab {shape['vocab']}, "
          f"{args.dtype}, W={width}, executor {'CUDA graphs' if engine.graphs is not None else 'eager'} "
          f"(built in {time.perf_counter() - t0:.1f}s)")
    rows = []
    first = min(entries, key=lambda e: e["prompt_tokens"])
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(3, shape["vocab"], (first["prompt_tokens"],), generator=gen).tolist()
    new = args.replay_hf_new

    # self-spec first (the prediction), then the baselines while the budget lasts
    replay_trace(engine, drafter, [first], data.get("tree_mode", True), args.seed, torch)  # warm-up, captures
    for trace_name, prompts in traces.items():
        result = replay_trace(engine, drafter, prompts, data.get("tree_mode", True), args.seed, torch)
        recorded = sum(c[2] for e in prompts for c in e["cycles"])
        if result["committed"] != recorded:
            failed.append(f"{name}: replay committed {result['committed']} tokens, trace {trace_name!r} {recorded}")
        ms = result["seconds"] / max(result["committed"], 1) * 1e3
        note = (f"tau {result['committed'] / max(result['cycles'], 1):.2f}, "
                f"{sum(result['rows']) / max(result['cycles'], 1):.2f} rows / cycle, {result['cycles']} cycles")
        rows.append((f"self-spec replay, trace {trace_name!r} (predicted)", ms, note))
    if engine.graphs is not None and engine.graphs.eager:
        failed.append(f"{name}: the replay engine's capture fell back: {engine.graphs.fallback_reason}")

    def engine_ar(p, n):
        return engine.generate_ar(p, n)

    def hf(p, n, **kw):
        ids = torch.tensor([p], device=DEVICE)
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0, **kw)

    draft_model = None
    baselines = [("engine AR (measured)", engine_ar, ""),
                 ("HF greedy generate() (measured)", hf, ""),
                 ("HF prompt lookup, 10 tokens (measured; random prompt: little to copy)",
                  lambda p, n: hf(p, n, prompt_lookup_num_tokens=10), ""),
                 ("HF assisted, 2-layer random draft (measured; the draft is rarely right)",
                  lambda p, n: hf(p, n, assistant_model=draft_model), "")]
    greedy_ms = None
    for label, run, note in baselines:
        if time.perf_counter() > deadline:
            rows.append((label, None, "skipped: --replay-budget spent"))
            continue
        if "assisted" in label and draft_model is None:
            torch.manual_seed(args.seed + 1)
            draft_cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=256, intermediate_size=1024,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=max(4096, capacity), tie_word_embeddings=True,
                                    bos_token_id=None, eos_token_id=None, pad_token_id=0)
            with torch.device(DEVICE):
                draft_model = LlamaForCausalLM(draft_cfg)
            draft_model = draft_model.to(next(model.parameters()).dtype).eval()
        try:
            ms = per_token_ms(run, prompt, new, torch)
        except Exception as error:  # noqa: BLE001 - a baseline HF refuses is reported, not fatal
            rows.append((label, None, f"failed: {type(error).__name__}: {error}"))
            continue
        rows.append((label, ms, note))
        if label.startswith("HF greedy"):
            greedy_ms = ms
    lookup = data.get("hf_prompt_lookup") or []
    if greedy_ms is not None and lookup:
        # HF prompt lookup's own passes on the real model (recorded on the CPU), each costed
        # as one HF greedy step here: its extra rows are nearly free on a GPU and its host
        # work per pass is HF's, so this favours HF a little
        lookup = lookup[: args.replay_prompts or None]
        passes = sum(h["passes"] for h in lookup)
        tokens = sum(h["new_tokens"] - 1 for h in lookup)
        rows.append(("HF prompt lookup on the real model's tokens (predicted: recorded passes x HF greedy step)",
                     passes * greedy_ms / max(tokens, 1),
                     f"{tokens / max(passes, 1):.2f} tokens / pass"))
    print(f"prompt for the measured rows: {len(prompt)} random tokens, {new} new; traces: "
          + ", ".join(f"{k!r} {len(v)} prompts" for k, v in traces.items()))
    print("| method | ms / token | tokens/s | x HF greedy | notes |")
    print("|---|---|---|---|---|")
    for label, ms, note in rows:
        if ms is None:
            print(f"| {label} | - | - | - | {note} |")
            continue
        ratio = f"{greedy_ms / ms:.2f}x" if greedy_ms else "-"
        print(f"| {label} | {ms:.3f} | {1e3 / ms:.0f} | {ratio} | {note} |")
    return rows


def replay_main(args) -> int:
    """--replay-only: every shape of --replay-shapes, within --replay-budget seconds."""
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from record_traces import load_traces

    started = time.perf_counter()
    deadline = started + args.replay_budget
    data = load_traces(args.replay_trace)
    print(f"# replay of {args.replay_trace}: {data['model']} with {data['heads']}, W={data['width']}, "
          f"{data['max_new_tokens']} new tokens; traces {', '.join(data['traces'])} ('cpu': the policy "
          "planned with the CPU's step costs, 'gpu': with a GPU's width curve)")
    failed: list[str] = []
    for name, shape in replay_shapes(args).items():
        if time.perf_counter() > deadline:
            print(f"\n## {name}: skipped, --replay-budget ({args.replay_budget:.0f} s) spent")
            continue
        try:
            replay_model(name, shape, data, args, deadline, torch, failed)
        except Exception as error:  # noqa: BLE001 - the next shape still runs
            import traceback

            traceback.print_exc()
            failed.append(f"{name}: {type(error).__name__}: {error}")
        gc.collect()  # the shape's model, engine and graphs, before the next one is built
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print(f"\nreplay took {time.perf_counter() - started:.0f} s")
    if failed:
        print("FAILED:\n  " + "\n  ".join(failed))
        return 1
    print("OK: every trace replayed with its recorded rows and committed tokens")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.replay_only:
        return replay_main(args)

    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    import transformers
    import triton

    from hf_selfspec.decoding.cycle import DecodeConfig, SelfSpecDecoder
    from hf_selfspec.engine.core import Engine, EngineConfig
    from hf_selfspec.engine.cuda_graphs import CudaGraphRunner

    N = args.new_tokens
    if N < 2:
        raise SystemExit("--new-tokens must be >= 2 (per-token times difference two runs)")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
          f"{triton.__version__} | transformers {transformers.__version__}")
    t0 = time.perf_counter()
    model = build_model(args, torch)
    params = sum(p.numel() for p in model.parameters())
    print(f"# model: {params / 1e9:.2f}B params, hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads}/{args.kv_heads} heads, {args.dtype}; built in {time.perf_counter() - t0:.1f}s")

    engine = Engine(model, EngineConfig(width=args.width, capacity=args.capacity, row_layout="fixed"))
    runner = CudaGraphRunner(engine)
    t0 = time.perf_counter()
    runner.warmup([("ar",), ("verify", 0)])
    torch.cuda.synchronize()
    print(f"# engine: W={engine.width}, layout {engine.layout.name}; captured {runner.captured} "
          f"in {time.perf_counter() - t0:.1f}s")
    failed = []
    if runner.eager:
        failed.append(f"capture fell back to eager: {runner.fallback_reason}")

    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, args.vocab, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]

    def hf_generate(prompt, new):
        ids = torch.tensor([prompt], device=DEVICE)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    def spec_generate(prompt, new):
        with runner.attached():
            return SelfSpecDecoder(engine, None, DecodeConfig(lookup="only")).generate(prompt, new)

    def graphs_ar(prompt, new):
        with runner.attached():
            return engine.generate_ar(prompt, new)

    # ---- parity -----------------------------------------------------------------------------
    print(f"\n## token parity ({args.prompts} random prompts of {args.prompt_len} tokens, {N} new)")
    print("| prompt | graphs == eager | spec == AR | drafted / accepted | engine == HF greedy "
          "| first divergence |")
    print("|---|---|---|---|---|---|")
    hf_matches = 0
    for i, prompt in enumerate(prompts):
        eager = engine.generate_ar(prompt, N)
        graphs = graphs_ar(prompt, N)
        spec = spec_generate(prompt, N)
        hf = hf_generate(prompt, N)
        diverge = next((j for j, (a, b) in enumerate(zip(graphs, hf)) if a != b), None)
        hf_matches += graphs == hf
        print(f"| {i} | {graphs == eager} | {spec.tokens == graphs} | "
              f"{spec.stats.drafted} / {spec.stats.accepted} | {graphs == hf} | "
              f"{'-' if diverge is None else diverge} |")
        if graphs != eager:
            failed.append(f"prompt {i}: graph AR tokens != eager AR tokens")
        if spec.tokens != graphs:
            failed.append(f"prompt {i}: speculative tokens != AR tokens")
    print(f"engine AR == HF greedy on {hf_matches}/{len(prompts)} prompts (measured rate)")

    # ---- timing -----------------------------------------------------------------------------
    def per_token(run, prompt) -> float:
        """Median over repeats of (t(N) - t(1)) / (N - 1), in ms."""
        run(prompt, N)  # warm-up (allocator, kernels, caches)
        samples = []
        for _ in range(args.repeats):
            times = []
            for new in (1, N):
                torch.cuda.synchronize()
                start = time.perf_counter()
                run(prompt, new)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            samples.append((times[1] - times[0]) / (N - 1) * 1e3)
        return statistics.median(samples)

    def replay_only(prompt) -> float | None:
        """GPU time of one `ar` graph replay (no host work between replays), in ms."""
        program = runner.program(("ar",))
        return None if program is None else ar_replay_ms(engine, program, prompt, N, torch)

    prompt = prompts[0]
    rows = [
        ("HF greedy generate()", per_token(hf_generate, prompt)),
        ("engine AR, eager", per_token(engine.generate_ar, prompt)),
        ("engine AR, CUDA graphs", per_token(graphs_ar, prompt)),
        ("`ar` graph replay only (GPU time)", replay_only(prompt)),
        ("speculative, lookup only, graphs", per_token(lambda p, n: spec_generate(p, n).tokens, prompt)),
    ]
    weights, kv = bytes_per_step(model, args, args.prompt_len + N // 2)
    bound_ms = weights / args.bandwidth * 1e3
    bound_kv_ms = (weights + kv) / args.bandwidth * 1e3
    print(f"\n## ms per new token (prompt {args.prompt_len}, {N} new; bandwidth "
          f"{args.bandwidth / 1e12:.2f} TB/s)")
    print(f"HBM bound: weights {weights / 1e9:.3f} GB -> {bound_ms:.3f} ms/step; "
          f"+ KV at mean context {args.prompt_len + N // 2} ({kv / 1e6:.1f} MB) -> {bound_kv_ms:.3f} ms")
    print("| program | ms/token | tokens/s | bound / time |")
    print("|---|---|---|---|")
    for name, ms in rows:
        if ms is None:
            print(f"| {name} | - | - | - |")
            continue
        print(f"| {name} | {ms:.3f} | {1e3 / ms:.0f} | {bound_ms / ms:.0%} |")

    # ---- trees, generate() with the graph executor -------------------------------------------
    graph_engine = Engine(model, EngineConfig(width=args.width, capacity=args.capacity,
                                              row_layout="fixed", executor="cuda_graphs"))
    check_trees(model, engine, graph_engine, prompts, N, torch, failed)

    from hf_selfspec import attach_heads, selfspec_state

    attach_heads(model, heads=False, engine=EngineConfig(width=args.width, capacity=args.capacity,
                                                         row_layout="fixed", executor="cuda_graphs"))

    def self_generate(prompt, new):
        ids = torch.tensor([prompt], device=DEVICE)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, pad_token_id=0, assistant="self")
        return out[0, len(prompt):].tolist()

    print("\n## generate(assistant='self'), graph executor, prompt lookup only")
    same = [self_generate(p, N) == engine.generate_ar(p, N) for p in prompts]
    print(f"tokens == engine AR on {sum(same)}/{len(prompts)} prompts")
    if not all(same):
        failed.append("generate(assistant='self') with graphs != engine AR")
    self_engine = selfspec_state(model).engine
    if self_engine.graphs is None or self_engine.graphs.eager:
        failed.append("generate(assistant='self') did not run the graph executor")
    hf_ms, self_ms = rows[0][1], per_token(self_generate, prompt)
    print(f"| generate() | ms/token | vs HF greedy |\n|---|---|---|\n| HF greedy | {hf_ms:.3f} | 1.00x |\n"
          f"| assistant='self', graphs | {self_ms:.3f} | {hf_ms / self_ms:.2f}x |")

    try:  # opt-in kernels: a failure here is reported as a failed check, the run goes on
        check_fused(model, engine, args, prompts, N, torch, failed)
    except Exception as error:  # noqa: BLE001
        failed.append(f"fused small kernels: {type(error).__name__}: {error}")

    # diagnostics: no invariant depends on them, so an error is printed and the run goes on
    for diagnostic in (lambda: print_kernel_table(runner, engine, prompt, args.profile_steps, torch),
                       lambda: print_width_sweep(model, args, prompt, torch)):
        try:
            diagnostic()
        except Exception as error:  # noqa: BLE001 - report and go on
            print(f"\n(diagnostic failed: {type(error).__name__}: {error})")

    if failed:
        print("\nFAILED:\n  " + "\n  ".join(failed))
        return 1
    print("\nOK: graphs == eager and speculative == AR on every prompt (chains and trees)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
