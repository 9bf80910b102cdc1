"""Fit a chain of top-layer draft steps (TopDraftHeads) on the model's own replies.

Step i predicts the model's argmax i+1 tokens after the committed token, from the state of
step i-1 and the token the text holds there (teacher forcing during training; the decoder
feeds its own drafts, which is what evaluate.py measures). The loss is the sum over steps of
the cross-entropy to the model's argmax within the heads' reduced vocabulary (the most
frequent target tokens); AdamW with a one-cycle learning-rate schedule (hard targets:
soft ones measured no better, docs/head_study.md).

Training is time-budgeted: a few timed batches give the seconds per optimiser step, and
the schedule is planned for as many steps as fit the budget, at most `max_epochs` passes.

Heads can start from trained ones (`start_heads` with an init folder): fine-tuning keeps
their reduced vocabulary and sizes; a greater depth adds steps (TopDraftHeads.deepened),
and `frozen_steps` in `fit` trains only the added ones (the earlier steps and the output
norm stay as they were: their drafts, the first ones, are the measured ones).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..heads.base import fingerprint, norm_eps
from ..heads.top import TOP_KIND, TopDraftHeads, TopHeadsConfig

DEFAULT_DEPTH = 3


@dataclass(frozen=True)
class FitSettings:
    depth: int | None = None  # None: the init heads' depth, or DEFAULT_DEPTH for new heads
    adapter_dim: int = 512
    vocab: int = 8192  # reduced vocabulary: the most frequent target tokens
    batch_size: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.05
    max_epochs: int = 4
    max_steps: int | None = None  # tests: stop after this many optimiser steps
    seed: int = 0


@dataclass(frozen=True)
class Examples:
    """Chain-start positions of a set of replies (N positions, depth D):
    f [N, H] final states, x [N, D] the text's tokens x_{t+1..t+D}, y [N, D] the model's
    argmaxes a_{t+1..t+D}, agree [N, D] whether x_{t+1+i} == a_{t+i} (the text is the
    model's own greedy continuation there)."""

    f: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    agree: torch.Tensor

    def __len__(self) -> int:
        return len(self.f)


def examples(data: dict, depth: int) -> Examples:
    """Examples of every masked position with `depth` tokens after it (data: data.load_split)."""
    fs, xs, ys, agree = [], [], [], []
    for ids, arg, fin, mask in zip(data["ids"], data["argmax"], data["final"], data["mask"]):
        T = len(ids)
        t = torch.nonzero(mask[: max(T - depth, 0)]).reshape(-1)
        if len(t) == 0:
            continue
        fs.append(fin[t])
        xs.append(torch.stack([ids[t + 1 + i] for i in range(depth)], 1))
        ys.append(torch.stack([arg[t + 1 + i] for i in range(depth)], 1))
        agree.append(torch.stack([ids[t + 1 + i] == arg[t + i] for i in range(depth)], 1))
    if not fs:
        raise ValueError(f"no reply is longer than depth {depth} + 1 tokens: collect more replies")
    return Examples(torch.cat(fs), torch.cat(xs).long(), torch.cat(ys).long(), torch.cat(agree))


def load_init(model, folder: Path) -> TopDraftHeads:
    """Trained top heads to fine-tune, bound to `model`, without their calibration (it is
    re-fitted for the new weights). ValueError for a folder that holds no top heads for
    `model`."""
    from ..heads.repo import load_heads

    try:
        heads = load_heads(folder, model, kind=TOP_KIND)
    except OSError as e:  # a missing folder or file
        raise ValueError(f"--init {folder}: {e}") from None
    heads.calibration = None
    return heads


def deepen(init: TopDraftHeads, depth: int, new_steps_only: bool) -> tuple[TopDraftHeads, int]:
    """(heads of `depth` steps starting from `init`, the number of steps to keep frozen).
    ValueError for a depth below the init's, or new_steps_only without added steps."""
    if depth < init.config.depth:
        raise ValueError(f"--depth {depth} is below the depth of the --init heads ({init.config.depth})")
    if new_steps_only and depth == init.config.depth:
        raise ValueError(f"--new-steps-only: --depth {depth} adds no steps to the --init heads "
                         f"(depth {init.config.depth})")
    heads = init.deepened(depth) if depth > init.config.depth else init
    return heads, init.config.depth if new_steps_only else 0


def depth_of(settings: FitSettings, init: TopDraftHeads | None) -> FitSettings:
    """`settings` with the depth resolved (None: the init's, or DEFAULT_DEPTH)."""
    if settings.depth is not None:
        return settings
    return replace(settings, depth=init.config.depth if init is not None else DEFAULT_DEPTH)


def new_heads(model, base_model: str, train: Examples, settings: FitSettings) -> TopDraftHeads:
    """Untrained heads for `model`: the reduced vocabulary is the `settings.vocab` most
    frequent targets of `train`; the output norm starts as the model's final norm."""
    from hf_selfspec.engine.layered import text_config

    cfg = text_config(model)
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    counts = torch.bincount(train.y.reshape(-1), minlength=vocab_size)
    vocab_ids = counts.argsort(descending=True, stable=True)[: min(settings.vocab, vocab_size)].sort().values
    config = TopHeadsConfig(
        base_model=base_model, base_fingerprint=fingerprint(model),
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, vocab_size=vocab_size,
        depth=settings.depth, adapter_dim=settings.adapter_dim, reduced_vocab=len(vocab_ids),
        rms_norm_eps=norm_eps(model))
    torch.manual_seed(settings.seed)
    return TopDraftHeads(config, vocab_ids).init_from_model(model)


def vocab_coverage(heads: TopDraftHeads, train: Examples) -> float:
    """Share of the training targets inside the heads' reduced vocabulary."""
    inside = torch.zeros(heads.config.vocab_size, dtype=torch.bool)
    inside[heads.vocab_ids.cpu()] = True
    return float(inside[train.y.reshape(-1)].float().mean())


def fit(heads: TopDraftHeads, train: Examples, settings: FitSettings, budget_s: float,
        progress: bool = True, frozen_steps: int = 0) -> dict:
    """Train `heads` (bound to their model) in float32 on `train` for at most `budget_s`
    seconds; returns figures for the model card. With `frozen_steps` > 0 only the steps
    from that one on are trained (the earlier ones and the output norm are kept). The
    heads are re-bound to the model's dtype afterwards by the caller (heads.bind(model))."""
    from tqdm.auto import tqdm

    device = heads.out_norm.device
    heads.float()
    heads.lm_rows, heads.embed = heads.lm_rows.float(), heads.embed.float()
    trained = [p for i, step in enumerate(heads.steps) if i >= frozen_steps for p in step.parameters()]
    if frozen_steps == 0:
        trained.append(heads.out_norm)
    heads.requires_grad_(False)  # no gradients for the frozen steps (set back below)
    for p in trained:
        p.requires_grad_(True)
    remap = torch.full((heads.config.vocab_size,), -100, dtype=torch.long, device=device)
    remap[heads.vocab_ids] = torch.arange(len(heads.vocab_ids), device=device)
    n, B = len(train), min(settings.batch_size, len(train))
    generator = torch.Generator().manual_seed(settings.seed)

    def loss_of(idx: torch.Tensor) -> torch.Tensor:
        h = train.f[idx].to(device, torch.float32)  # [b, H]
        x, y = train.x[idx].to(device), train.y[idx].to(device)  # [b, D]
        loss = 0.0
        for i in range(heads.config.depth):
            h, logits = heads.step_logits(i, h, x[:, i])
            loss = loss + F.cross_entropy(logits.float(), remap[y[:, i]], ignore_index=-100)
        return loss

    # seconds per step, measured on a few batches (backward included, no update)
    t0, probes = time.monotonic(), 3
    for _ in range(probes):
        loss_of(torch.randint(n, (B,), generator=generator)).backward()
    heads.zero_grad(set_to_none=True)
    step_s = (time.monotonic() - t0) / probes
    per_epoch = max(n // B, 1)
    steps = max(1, min(settings.max_epochs * per_epoch, int((budget_s - (time.monotonic() - t0)) / step_s)))
    if settings.max_steps is not None:
        steps = min(steps, settings.max_steps)
    opt = torch.optim.AdamW(trained, lr=settings.lr, weight_decay=settings.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=settings.lr, total_steps=steps)
    heads.train()
    t_train, total, last = time.monotonic(), 0.0, float("nan")
    with tqdm(total=steps, desc="train heads", unit="step", disable=not progress) as bar:
        step = 0
        while step < steps:
            perm = torch.randperm(n, generator=generator)
            for b in range(per_epoch):
                if step >= steps:
                    break
                loss = loss_of(perm[b * B:(b + 1) * B])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                last = float(loss.detach())
                total += last
                step += 1
                bar.update(1)
                if step % 20 == 0:
                    bar.set_postfix(loss=f"{last:.3f}", refresh=False)
    heads.eval()
    heads.requires_grad_(True)
    return {"train_positions": n, "steps": steps, "batch": B, "epochs": round(steps * B / n, 2),
            "final_loss": round(last, 4), "mean_loss": round(total / steps, 4),
            "train_seconds": round(time.monotonic() - t_train, 1), "lr": settings.lr,
            "adapter": heads.config.adapter_dim, "loss": "hard", "variant": "chain",
            "new_steps_only": frozen_steps > 0}
