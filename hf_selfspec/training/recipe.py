"""The whole top-head recipe under one time budget: replies -> fit -> evaluate -> calibrate -> save.

Budget split (the clock starts once the model is loaded):

    COLLECT_SHARE (80%)   the model's greedy replies; of these, EVAL_SHARE (20%) for the
                          held-out split until it holds MAX_EVAL_POSITIONS positions (time
                          it does not need goes to training replies)
    the rest (20%)        fitting the heads, less RESERVE_SHARE (5% of the total) kept for
                          the held-out evaluation, calibration and saving

Collection is the expensive part (one batched decoding step of the whole model per reply
position, against one small MLP chain per position for training), so it gets most of the
time. Replies are cached in OUT/work/ (data.py); a second run on the same folder continues
collecting where the first stopped and trains on everything collected so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..heads.base import final_norm, lm_head_weight
from ..heads.repo import save_heads
from .data import CollectSettings, PromptSource, WorkState, collect_split, load_split, work_key
from .evaluate import calibrate, evaluate
from .train import FitSettings, examples, fit, new_heads, vocab_coverage

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

    def validate(self) -> None:
        if not self.minutes > 0:
            raise ValueError(f"--minutes must be > 0, got {self.minutes}")
        if self.prompts is not None and not Path(self.prompts).is_file():
            raise ValueError(f"prompts file {self.prompts} does not exist")
        if self.fit.depth < 1:
            raise ValueError(f"--depth must be >= 1, got {self.fit.depth}")
        if self.collect.batch_size < 1 or self.collect.max_new_tokens < 2:
            raise ValueError("--batch-size must be >= 1 and --max-new-tokens >= 2")
        if self.fit.max_steps is not None and self.fit.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1, got {self.fit.max_steps}")
        if self.collect.max_new_tokens <= self.fit.depth + 1:
            raise ValueError(f"--max-new-tokens must exceed --depth + 1 ({self.fit.depth + 1})")


def check_model(model) -> None:
    """ValueError unless `model` is a causal LM the heads support (a Llama-family final
    norm at model.model.norm, an LM head, generate)."""
    if not callable(getattr(model, "generate", None)):
        raise ValueError(f"{type(model).__name__} is not a causal LM with generate()")  # noqa: TRY004
    final_norm(model)
    lm_head_weight(model)


def train_top_heads(model, tokenizer, config: RecipeConfig, log=print) -> dict:
    """Run the recipe; returns the figures saved in the heads' config.json `training`."""
    config.validate()
    check_model(model)
    t0 = time.monotonic()
    budget = config.minutes * 60.0
    out = Path(config.out)
    work = out / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    source = PromptSource(Path(config.prompts) if config.prompts is not None else None)
    state = WorkState.open(work, work_key(model, source, config.collect))

    # 1. replies: held-out first, so a short run still has an evaluation set
    collect_s = budget * COLLECT_SHARE
    eval_s = collect_s * EVAL_SHARE
    collect_split(model, tokenizer, source, "eval", work, state, config.collect, eval_s,
                  MAX_EVAL_POSITIONS, config.progress)
    collect_split(model, tokenizer, source, "train", work, state, config.collect,
                  collect_s - (time.monotonic() - t0), None, config.progress)
    ev_state, tr_state = state.splits["eval"], state.splits["train"]
    log(f"replies: {tr_state.positions} training positions ({tr_state.replies} replies), "
        f"{ev_state.positions} held-out ({ev_state.replies} replies), collected in "
        f"{tr_state.seconds + ev_state.seconds:.0f} s over all runs")
    if tr_state.replies == 0 or ev_state.replies == 0:
        raise ValueError("no replies collected for training or held-out evaluation: give more --minutes "
                         "or more prompts")

    # 2. fit
    depth = config.fit.depth
    train_ex = examples(load_split(work, state, "train"), depth)
    eval_ex = examples(load_split(work, state, "eval"), depth)
    heads = new_heads(model, config.base_model, train_ex, config.fit)
    fit_s = budget * (1 - RESERVE_SHARE) - (time.monotonic() - t0)
    figures = fit(heads, train_ex, config.fit, max(fit_s, 1.0), config.progress)
    heads.bind(model)  # back to the model's dtype and device

    # 3. evaluate, calibrate, save
    report = evaluate(heads, eval_ex)
    calibration, calib_figures = calibrate(heads, eval_ex, config.min_accept)
    heads.calibration = calibration
    collected_s = tr_state.seconds + ev_state.seconds
    report.update(figures)
    report.update(
        vocab_coverage=round(vocab_coverage(heads, train_ex), 4),
        calibration=calib_figures,
        collection={"train_positions": tr_state.positions, "eval_positions": ev_state.positions,
                    "train_replies": tr_state.replies, "eval_replies": ev_state.replies,
                    "seconds": round(collected_s, 1),
                    "positions_per_s": round((tr_state.positions + ev_state.positions) / max(collected_s, 1e-9), 1),
                    **vars(config.collect)},
        prompts=source.name,
        datasets=[SHAREGPT_DATASET] if config.prompts is None else [],
        minutes=config.minutes,
        wall_seconds=round(time.monotonic() - t0, 1),
    )
    if config.command:
        report["reproduce"] = config.command
    heads.config.training = report
    save_heads(heads, out)
    log(f"saved {out}: held-out tau {report.get('own_eval_tau_thr0.0')} over "
        f"{report.get('own_eval_positions')} positions, per-step top-1 "
        f"{[report.get(f'own_eval_step{i}_top1_given_reached') for i in range(depth)]}")
    return report
