"""The whole top-head recipe under one time budget: replies -> fit -> evaluate -> calibrate -> save.

Budget split (the clock starts once the model is loaded):

    COLLECT_SHARE (80%)   the model's greedy replies; of these, EVAL_SHARE (20%) for the
                          held-out split until it holds MAX_EVAL_POSITIONS positions (time
                          it does not need goes to training replies)
    the rest (20%)        fitting the heads, less RESERVE_SHARE (5% of the total) kept for
                          the held-out evaluation, calibration and saving

Collection is the expensive part (one batched decoding step of the whole model per reply
position, against one small MLP chain per position for training), so it gets most of the
time. Replies are cached in OUT/work/ or `work` (data.py); a second run on the same
folder continues collecting where the first stopped (a new part of the data) and trains
on everything collected so far.

`only="collect"` spends the whole budget collecting (no heads are saved); `only="train"`
spends it fitting, on what the work folder holds (all parts, or `parts`). So a longer
collection is several collect runs, then one train run; heads can start from trained
ones (`init`, deepened to a greater depth, `new_steps_only`). The shipped default heads
were made this way: scripts/head_study.py runs their chain of commands.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..heads.base import final_norm, lm_head_weight
from ..heads.repo import load_heads, save_heads
from ..heads.top import TOP_KIND
from .data import (
    CollectSettings,
    PromptSource,
    WorkState,
    collect_split,
    load_split,
    read_prompts_file,
    work_key,
)
from .evaluate import calibrate, evaluate
from .train import (
    FitSettings,
    deepen,
    depth_of,
    examples,
    fit,
    load_init,
    new_heads,
    vocab_coverage,
)

COLLECT_SHARE = 0.8
EVAL_SHARE = 0.2
RESERVE_SHARE = 0.05
MAX_EVAL_POSITIONS = 20_000
WORK_DIR = "work"
SHAREGPT_DATASET = "anon8231489123/ShareGPT_Vicuna_unfiltered"


@dataclass(frozen=True)
class RecipeConfig:
    out: Path
    minutes: float
    base_model: str  # the id the heads' config and card name
    prompts: Path | None = None  # None: the ShareGPT package
    collect: CollectSettings = field(default_factory=CollectSettings)
    fit: FitSettings = field(default_factory=FitSettings)
    min_accept: float = 0.0
    command: str = ""  # the command line, for the model card
    progress: bool = True
    work: Path | None = None  # the replies' cache; None: OUT/work
    only: Literal["collect", "train"] | None = None  # one stage with the whole budget
    init: Path | None = None  # trained top heads to fine-tune (deepened to fit.depth)
    new_steps_only: bool = False  # with init and a greater depth: train the added steps only
    parts: tuple[int, ...] | None = None  # train on these parts of the training split only

    @property
    def work_dir(self) -> Path:
        return Path(self.work) if self.work is not None else Path(self.out) / WORK_DIR

    def validate(self) -> None:
        """ValueError naming the flag, before any model is loaded."""
        if not 0 < self.minutes < math.inf:  # the budget sizes progress bars and schedules
            raise ValueError(f"--minutes must be a finite number > 0, got {self.minutes}")
        if self.prompts is not None:
            read_prompts_file(self.prompts)  # every line, so a bad one fails before the model loads
        for flag, folder in (("--out", Path(self.out)), ("--work", self.work_dir)):
            if any(p.exists() and not p.is_dir() for p in (folder, *folder.parents)):
                raise ValueError(f"{flag} {folder}: a file is in the way of this folder")
        depth = self.fit.depth
        if depth is not None and depth < 1:
            raise ValueError(f"--depth must be >= 1, got {depth}")
        if self.collect.batch_size < 1 or self.collect.max_new_tokens < 2:
            raise ValueError("--batch-size must be >= 1 and --max-new-tokens >= 2")
        if self.fit.max_steps is not None and self.fit.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1, got {self.fit.max_steps}")
        if self.fit.max_epochs < 1 or self.fit.batch_size < 1 or not 0 < self.fit.lr < math.inf:
            raise ValueError("--epochs and --train-batch must be >= 1 and --lr a finite number > 0")
        if depth is not None and self.collect.max_new_tokens <= depth + 1:
            raise ValueError(f"--max-new-tokens must exceed --depth + 1 ({depth + 1})")
        if self.only not in (None, "collect", "train"):
            raise ValueError(f"--only must be 'collect' or 'train', got {self.only!r}")
        training = {"--init": self.init is not None, "--new-steps-only": self.new_steps_only,
                    "--parts": self.parts is not None}
        if self.only == "collect" and any(training.values()):
            flags = ", ".join(k for k, v in training.items() if v)
            raise ValueError(f"{flags}: training flags, not for --only collect")
        if self.init is not None and not (Path(self.init) / "config.json").is_file():
            raise ValueError(f"--init {self.init}: no heads there (no config.json)")
        if self.init is not None:
            load_heads(self.init, kind=TOP_KIND)  # every file of it, and its kind, before the model loads
        if self.new_steps_only and (self.init is None or depth is None):
            raise ValueError("--new-steps-only needs --init and a --depth greater than the init heads'")
        if self.parts is not None and (not self.parts or min(self.parts) < 0):
            raise ValueError(f"--parts must be part numbers >= 0, got {self.parts}")


def check_model(model) -> None:
    """ValueError unless `model` is a causal LM the heads support: an architecture the
    engine runs (named where not), with a final norm, an LM head and generate() (the
    recipe collects with HF's own generate(), on any device)."""
    from hf_selfspec.engine.layered import check_model_type

    if not callable(getattr(model, "generate", None)):
        raise ValueError(f"{type(model).__name__} is not a causal LM with generate()")  # noqa: TRY004
    check_model_type(model)
    final_norm(model)
    lm_head_weight(model)


def train_top_heads(model, tokenizer, config: RecipeConfig, log=print) -> dict:
    """Run the recipe (or one stage of it, config.only); returns the figures saved in the
    heads' config.json `training` (after `only="collect"`: the collection's)."""
    config.validate()
    check_model(model)
    t0 = time.monotonic()
    budget = config.minutes * 60.0
    work = config.work_dir
    work.mkdir(parents=True, exist_ok=True)
    source = PromptSource(Path(config.prompts) if config.prompts is not None else None)
    state = WorkState.open(work, work_key(model, source, config.collect))
    init = load_init(model, Path(config.init)) if config.init is not None else None
    settings = depth_of(config.fit, init)
    if init is not None:  # before collecting: a bad depth fails in seconds
        init_training = dict(init.config.training or {})
        heads, frozen = deepen(init, settings.depth, config.new_steps_only)

    # 1. replies: held-out first, so a short run still has an evaluation set
    if config.only != "train":
        collect_s = budget * (1.0 if config.only == "collect" else COLLECT_SHARE)
        collect_split(model, tokenizer, source, "eval", work, state, config.collect, collect_s * EVAL_SHARE,
                      MAX_EVAL_POSITIONS, config.progress)
        collect_split(model, tokenizer, source, "train", work, state, config.collect,
                      collect_s - (time.monotonic() - t0), None, config.progress)
    collection = collection_figures(state, config.collect)
    log(f"{work}: {collection['train_positions']} training positions ({collection['train_replies']} replies, "
        f"{collection['parts']} part(s)), {collection['eval_positions']} held-out "
        f"({collection['eval_replies']} replies), collected in {collection['seconds']:.0f} s over all runs")
    if config.only == "collect":
        return {"collection": collection}
    if state.splits["train"].replies == 0 or state.splits["eval"].replies == 0:
        more = "run --only collect first" if config.only == "train" else "give more --minutes or more prompts"
        raise ValueError(f"no replies collected for training or held-out evaluation in {work}: {more}")

    # 2. fit
    parts = list(config.parts) if config.parts is not None else None
    train_ex = examples(load_split(work, state, "train", parts), settings.depth)
    eval_ex = examples(load_split(work, state, "eval"), settings.depth)
    if init is None:
        heads, frozen = new_heads(model, config.base_model, train_ex, settings), 0
    fit_s = budget * (1 - RESERVE_SHARE) - (time.monotonic() - t0)
    figures = fit(heads, train_ex, settings, max(fit_s, 1.0), config.progress, frozen_steps=frozen)
    heads.bind(model)  # back to the model's dtype and device

    # 3. evaluate, calibrate, save
    report = evaluate(heads, eval_ex)
    calibration, calib_figures = calibrate(heads, eval_ex, config.min_accept)
    heads.calibration = calibration
    report.update(figures)
    report.update(
        data="tf" if config.collect.replies == "teacher_forced" else "own",
        vocab_coverage=round(vocab_coverage(heads, train_ex), 4),
        calibration=calib_figures,
        collection=collection,
        prompts=source.name,
        datasets=[SHAREGPT_DATASET] if config.prompts is None else [],
        minutes=config.minutes,
        wall_seconds=round(time.monotonic() - t0, 1),
    )
    if parts is not None:
        report["parts"] = sorted(set(parts))
    if init is not None:  # provenance for the model card: what was fine-tuned
        report["init_training"] = init_training
    if config.command:
        report["reproduce"] = config.command
    heads.config.training = report
    save_heads(heads, Path(config.out))
    # the chain alone (all drafts, no threshold): decoding's tau differs (thresholds, lookup)
    log(f"saved {config.out}: held-out tau of the full chain without thresholds "
        f"{report.get('own_eval_tau_thr0.0')} (decoding: hf-selfspec generate --compare) over "
        f"{report.get('own_eval_positions')} positions, per-step top-1 "
        f"{[report.get(f'own_eval_step{i}_top1_given_reached') for i in range(settings.depth)]}")
    return report


def collection_figures(state: WorkState, settings: CollectSettings) -> dict:
    """What the work folder holds, for the log and the model card."""
    ev, tr = state.splits["eval"], state.splits["train"]
    seconds = tr.seconds + ev.seconds
    return {"train_positions": tr.positions, "eval_positions": ev.positions,
            "train_replies": tr.replies, "eval_replies": ev.replies,
            "parts": len(tr.runs) or int(tr.parts > 0), "seconds": round(seconds, 1),
            "positions_per_s": round((tr.positions + ev.positions) / max(seconds, 1e-9), 1),
            **vars(settings)}
