"""The `hf-selfspec` command: generate (streaming, tokens coloured by source), train-heads,
push-heads, bench, train-exit-heads.

`train-heads` (top-layer draft heads) and `train-exit-heads` (exit heads) train heads for a
model with hf_selfspec.training, part of the package. `bench` runs scripts/bench.py of a
source checkout with every argument passed through (`hf-selfspec bench --help` is the
script's own help); a pip install has no scripts/ and says so in one line. Any error
prints one line and exits with status 2 (HF_SELFSPEC_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from pathlib import Path

# ANSI colours of token sources in the terminal
_RESET = "\033[0m"
_COLOURS = {"model": _RESET, "copy": "\033[36m", "draft_model": "\033[31m"}
_HEAD_COLOURS = ["\033[33m", "\033[32m", "\033[35m", "\033[34m"]


def _colour(source: str) -> str:
    if source.startswith("head"):
        return _HEAD_COLOURS[int(source[4:]) % len(_HEAD_COLOURS)]
    return _COLOURS.get(source, _RESET)


@contextlib.contextmanager
def _after_the_reply():
    """Warnings and log records (transformers' loggers, ours among them) raised while a reply
    streams are written to stderr once the block ends: written at once, on a terminal, they
    would land in the middle of the streamed text."""
    import io
    import logging
    import warnings

    handlers = [h for name in ("", "transformers", "hf_selfspec") for h in logging.getLogger(name).handlers
                if type(h) is logging.StreamHandler]  # a FileHandler's lines split no reply
    held = [(h, h.setStream(io.StringIO())) for h in handlers]  # setStream returns the old stream
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:  # the filters as they were: "once" holds
            yield
    finally:
        sys.stdout.flush()
        for handler, stream in held:
            text = handler.setStream(stream).getvalue()
            if text:
                stream.write(text)
                stream.flush()
        for w in caught:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def model_source(value: str, flag: str) -> str:
    """A local folder that exists or a Hub id ORG/NAME; a path that names no folder is
    refused here (transformers would call it an invalid repo id)."""
    from .heads.repo import names_a_local_path

    path = Path(value).expanduser()
    if path.is_dir():
        return str(path)
    if names_a_local_path(value):
        raise ValueError(f"{flag} {value}: no such model folder (pass a folder with config.json and the "
                         "weights, or a Hub id ORG/NAME)")
    return value


def _load(args):
    import hf_selfspec
    from hf_selfspec import DecodeConfig

    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32").eval()
        heads = False if args.heads == "none" else args.heads
        decode = DecodeConfig(lookup=args.lookup) if args.lookup else None
        return hf_selfspec.attach_heads(model, heads, decode=decode), tokenizer
    from hf_selfspec.defaults import load_default_model_and_tokenizer

    model, tokenizer = load_default_model_and_tokenizer()
    heads = False if args.heads == "none" else args.heads
    decode = DecodeConfig(lookup=args.lookup) if args.lookup else None
    return hf_selfspec.attach_heads(model, heads, decode=decode), tokenizer


def cmd_generate(args) -> int:
    import time

    import torch

    # a folder that does not exist is refused before anything loads
    args.model = args.model and model_source(args.model, "--model")
    args.draft_model = args.draft_model and model_source(args.draft_model, "--draft-model")
    torch.set_num_threads(args.threads)
    model, tokenizer = _load(args)
    from hf_selfspec.training.data import prompt_ids

    # the chat template where the tokenizer has one; a base model's (GPT-2, OPT) the plain text
    ids = torch.tensor([prompt_ids(tokenizer, [{"role": "user", "content": args.prompt}])])
    colour = sys.stdout.isatty() and not args.no_colour

    class SourceStreamer:
        """Prints each committed chunk as it arrives, each token coloured by its source
        (model.selfspec_stats is filled live: its sources are known at each put)."""

        def __init__(self):
            self.seen_prompt = False
            self.tokens: list[int] = []
            self.text = ""

        def put(self, value):
            if not self.seen_prompt:  # generate() streams the prompt first
                self.seen_prompt = True
                return
            sources = model.selfspec_stats.sources
            for token in value.reshape(-1).tolist():
                source = sources[len(self.tokens)] if len(self.tokens) < len(sources) else "model"
                self.tokens.append(token)
                text = tokenizer.decode(self.tokens, skip_special_tokens=True)
                piece, self.text = text[len(self.text):], text
                sys.stdout.write(_colour(source) + piece + _RESET if colour else piece)
            sys.stdout.flush()

        def end(self):
            sys.stdout.write("\n")

    draft_model = None
    if args.draft_model:
        from transformers import AutoModelForCausalLM

        draft_model = AutoModelForCausalLM.from_pretrained(args.draft_model, dtype=model.dtype).eval()
    # once per process: the engine is built (row-layout self-test, KV cache) and its step
    # costs measured on the first assistant="self" call; done here, untimed and said so,
    # so the timed run (and --compare) shows the steady-state speed a long-lived process gets
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=2, do_sample=False, assistant="self", assistant_model=draft_model)
    if args.compare:
        model.generate(ids, max_new_tokens=2, do_sample=False)  # HF's first-call costs, likewise
    compact = getattr(getattr(model._selfspec, "engine", None), "compact", None)
    held = "" if compact is None else (f"; {compact.count} projections read as the exact GGUF blocks "
                                        f"they hold, {compact.copy_bytes / 2**20:.0f} MiB")
    print(f"[hf-selfspec] engine ready in {time.perf_counter() - t0:.1f} s (once per process, untimed{held})")
    t0 = time.perf_counter()
    with _after_the_reply():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                             assistant="self", assistant_model=draft_model, streamer=SourceStreamer())
    elapsed = time.perf_counter() - t0
    stats = model.selfspec_stats
    if colour:
        legend = " ".join(_colour(s) + s + _RESET for s in sorted(set(stats.sources)))
        print(f"sources: {legend}  (model: the model's own token; copy: prompt lookup; headK: draft head K; "
              "draft_model: the draft model)")
    print(f"[hf-selfspec] {stats.summary()} | wall {elapsed:.2f} s")
    if args.compare:
        t0 = time.perf_counter()
        ref = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        t_ref = time.perf_counter() - t0
        same = torch.equal(ref, out)
        n = ref.shape[1] - ids.shape[1]
        print(f"[hf greedy] {n} tokens in {t_ref:.2f} s ({n / t_ref:.1f} tok/s) | identical: {same} "
              f"| speed-up {t_ref / elapsed:.2f}x")
    return 0


# subcommands that run a script of the source checkout, all arguments passed through
SCRIPT_COMMANDS = {
    "bench": ("bench.py", "benchmark vs HF greedy / prompt lookup / early exit, side by side "
                          "(--model, --heads, --draft-model, --methods, --per-category, "
                          "--max-new-tokens, ...)"),
}
# subcommands of the package itself, all arguments passed to their own parser
PACKAGE_COMMANDS = {
    "train-heads": ("hf_selfspec.training.cli", "train top-layer draft heads for a model on its own "
                                                "greedy replies: MODEL --out DIR --minutes N"),
    "train-exit-heads": ("hf_selfspec.training.exit_heads", "train exit heads (early layers) for a model by "
                                                            "self-distillation (--model, --out, --num-heads, ...)"),
}


def _scripts_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "scripts"


def _run_script(name: str, rest: list[str]) -> int:
    script = _scripts_dir() / name
    if not script.is_file():
        print(f"hf-selfspec: error: {script} not found: this command runs scripts/{name} of a source "
              "checkout (git clone the hf_selfspec repository and pip install -e it); a pip install "
              "has no scripts", file=sys.stderr)
        return 2
    if rest[:1] == ["--"]:  # `hf-selfspec bench -- --flag`: the separator is ours, not the script's
        rest = rest[1:]
    command = next(c for c, (file, _) in SCRIPT_COMMANDS.items() if file == name)
    # the script's --help names the command the user typed, not the script file
    env = dict(os.environ, HF_SELFSPEC_PROG=f"hf-selfspec {command}")
    return subprocess.call([sys.executable, str(script), *rest], env=env)


def cmd_push_heads(args) -> int:
    """Validate a heads folder of any kind with the loader, then upload it (huggingface_hub)."""
    from hf_selfspec.heads import push_heads

    try:
        commit = push_heads(args.folder, args.repo_id, token=args.token, private=args.private,
                            revision=args.revision, commit_message=args.commit_message)
    except (FileNotFoundError, ValueError) as e:  # a bad folder: say why, upload nothing
        print(f"push-heads: {e}", file=sys.stderr)
        return 2
    print(f"pushed {args.folder} to {getattr(commit, 'commit_url', None) or commit}")
    return 0


def _positive_int(text: str) -> int:
    """argparse type of a count that must be >= 1: refused as a usage error, before the model
    loads and the engine is built (HF's own error would come only after those)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-selfspec",
        description="Exact self-speculative decoding for Hugging Face models: cheap drafters (draft "
                    "heads trained on the model's own hidden states, prompt lookup, a draft model) "
                    "propose tokens and the model verifies them in one pass; same tokens as greedy, "
                    "faster.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a reply, coloured by token source, then a stats line")
    g.add_argument("prompt", help="the user message (the model's chat template is applied)")
    g.add_argument("--model", default=None, help="HF model folder or id (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--heads", default=None, help="heads folder or Hub id; 'none' for prompt lookup only "
                   "(default: the shipped heads for the default model; another --model without "
                   "heads drafts with prompt lookup)")
    g.add_argument("--lookup", choices=["off", "only", "first", "fallback"], default=None,
                   help="prompt lookup mode (default: first with heads, only without)")
    g.add_argument("--draft-model", default=None,
                   help="HF folder or id of a smaller model with the same tokenizer: it drafts "
                        "instead of the heads (classical speculative decoding, still exact)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128)
    g.add_argument("--threads", type=_positive_int, default=min(2, os.cpu_count() or 1))
    g.add_argument("--compare", action="store_true", help="also run plain HF greedy and compare")
    g.add_argument("--no-colour", action="store_true")
    g.set_defaults(func=cmd_generate)

    for command, (module, text) in PACKAGE_COMMANDS.items():
        sub.add_parser(command, help=f"{text}; flags: hf-selfspec {command} --help", add_help=False)
    for command, (script, text) in SCRIPT_COMMANDS.items():
        # listed here for the help; main() hands their arguments to the script untouched
        sub.add_parser(command, help=f"{text}; flags: hf-selfspec {command} --help (scripts/{script})",
                       add_help=False)

    p = sub.add_parser("push-heads", help="validate a heads folder (any kind) and upload it to the Hub")
    p.add_argument("folder", help="a folder written by save_heads (config.json, heads.safetensors, ...)")
    p.add_argument("repo_id", help="Hub model repo ORG/NAME (created if needed)")
    p.add_argument("--token", default=None, help="Hub token (default: the logged-in one)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", default=None, help="branch to upload to (created if needed)")
    p.add_argument("--commit-message", default=None)
    p.set_defaults(func=cmd_push_heads)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SCRIPT_COMMANDS:
        return _run_script(SCRIPT_COMMANDS[argv[0]][0], argv[1:])
    if argv and argv[0] in PACKAGE_COMMANDS:
        import importlib

        return int(importlib.import_module(PACKAGE_COMMANDS[argv[0]][0]).main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)  # usage errors: argparse's message, status 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # noqa: BLE001 -- one line for the user, not a traceback
        if os.environ.get("HF_SELFSPEC_DEBUG"):
            raise
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"hf-selfspec: error: {message} ({type(error).__name__}; HF_SELFSPEC_DEBUG=1 shows "
              "the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
