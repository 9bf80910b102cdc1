"""`hf-selfspec train-heads MODEL --out DIR --minutes N`: top-layer heads for any supported model.

    hf-selfspec train-heads default --out my_heads --minutes 60
    hf-selfspec train-heads ./my-llama --out my_heads --minutes 30 --prompts prompts.jsonl --device cuda

MODEL is a Hugging Face folder or repo id (loaded in its own dtype), or `default` (the
embedded SmolLM2-135M-Instruct). The folder DIR receives config.json, heads.safetensors,
calibration.json and README.md (the model card, with the held-out figures and this
command), and DIR/work/ (or --work) the cached replies: run the same command again to
collect more and retrain. Time split: hf_selfspec/training/recipe.py.

Collect more, then train on all of it (each collect run adds one part; --parts picks some):

    hf-selfspec train-heads default --out my_heads --work replies --only collect --minutes 60
    hf-selfspec train-heads default --out my_heads --work replies --only train --minutes 10

Fine-tune trained heads, or deepen them (train only the added step):

    hf-selfspec train-heads default --out deeper --work replies --only train --minutes 10 \\
        --init my_heads --depth 4 --new-steps-only --lr 1e-3

The shipped default heads' whole chain: scripts/head_study.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from .data import CollectSettings
from .recipe import RecipeConfig, train_top_heads
from .train import DEFAULT_DEPTH, FitSettings


def parse_parts(text: str) -> tuple[int, ...]:
    """'2,3,5' or '2-5' (or both, '0,2-4') -> part numbers; argparse's error otherwise."""
    parts = []
    try:
        for item in text.split(","):
            lo, _, hi = item.strip().partition("-")
            parts += range(int(lo), int(hi) + 1) if hi else [int(lo)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected part numbers like 2,3,5 or 2-5, got {text!r}") from None
    if not parts or min(parts) < 0:
        raise argparse.ArgumentTypeError(f"expected part numbers >= 0, got {text!r}")
    return tuple(parts)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hf-selfspec train-heads", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", metavar="MODEL", help="HF folder or repo id, or 'default'")
    ap.add_argument("--out", required=True, type=Path, help="folder for the heads (and work/ cache)")
    ap.add_argument("--minutes", required=True, type=float, help="time budget, collection + training")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--prompts", type=Path, default=None,
                    help='JSONL, one {"prompt": ...} or {"messages": [...]} per line (default: ShareGPT)')
    ap.add_argument("--depth", type=int, default=None,
                    help=f"drafts per chain (chain steps; default {DEFAULT_DEPTH}, with --init the init's)")
    ap.add_argument("--work", type=Path, default=None, help="folder of the cached replies (default OUT/work)")
    ap.add_argument("--only", choices=["collect", "train"], default=None,
                    help="collect: spend the budget on replies (adds a part); train: on fitting what --work holds")
    ap.add_argument("--parts", type=parse_parts, default=None,
                    help="train on these parts of the collected data only, e.g. 2,3,4,5 or 2-5 (default all)")
    ap.add_argument("--init", type=Path, default=None, help="fine-tune these top heads (a folder) instead of new ones")
    ap.add_argument("--new-steps-only", action="store_true",
                    help="with --init and a greater --depth: train only the added steps")
    ap.add_argument("--teacher-forced", action="store_true",
                    help="the prompts' whole conversations, teacher-forced, instead of the model's replies "
                         "(cheaper, worth less per position; use a --work of its own)")
    ap.add_argument("--epochs", type=int, default=FitSettings.max_epochs, help="at most this many passes")
    ap.add_argument("--lr", type=float, default=FitSettings.lr, help="peak learning rate (one-cycle)")
    ap.add_argument("--train-batch", type=int, default=FitSettings.batch_size, help="positions per optimiser step")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--batch-size", type=int, default=CollectSettings.batch_size, help="prompts per generate batch")
    ap.add_argument("--max-new-tokens", type=int, default=CollectSettings.max_new_tokens, help="reply length cap")
    ap.add_argument("--max-steps", type=int, default=None, help="cap on optimiser steps (tests)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ap


def load_model(name: str, device: str):
    """(model, tokenizer, base model id) in the model's own dtype, eval mode, on `device`."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if name == "default":
        from ..defaults import DEFAULT_MODEL_ID, load_default_model_and_tokenizer

        model, tokenizer = load_default_model_and_tokenizer()
        base = DEFAULT_MODEL_ID
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..cli import model_source

        name = model_source(name, "MODEL")
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, dtype="auto")
        except (OSError, ValueError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"cannot load model {name!r}: {first}") from None
        base = name
    return model.to(device).eval(), tokenizer, base


def main(argv: list[str] | None = None, command: str | None = None) -> int:
    """Exit status 0, or 2 with one line on stderr for bad input. `command`: what the model
    card names as the command that made the heads (default: this command line)."""
    args = build_parser().parse_args(argv)
    if command is None:
        command = "hf-selfspec train-heads " + shlex.join(sys.argv[1:] if argv is None else argv)
    config = RecipeConfig(
        out=args.out, minutes=args.minutes, base_model=args.model, prompts=args.prompts,
        collect=CollectSettings(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                                replies="teacher_forced" if args.teacher_forced else "own"),
        fit=FitSettings(depth=args.depth, max_steps=args.max_steps, max_epochs=args.epochs, lr=args.lr,
                        batch_size=args.train_batch),
        command=command, progress=not args.no_progress, work=args.work, only=args.only, init=args.init,
        new_steps_only=args.new_steps_only, parts=args.parts)
    import torch

    threads = torch.get_num_threads()
    try:
        config.validate()  # before the model loads: bad input fails in a second
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
        model, tokenizer, base = load_model(args.model, args.device)
        config = dataclasses.replace(config, base_model=base)
        train_top_heads(model, tokenizer, config)
    except ValueError as e:
        print(f"hf-selfspec train-heads: error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)  # main() may run inside a larger program (tests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
