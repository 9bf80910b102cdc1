"""Training top-layer draft heads (heads/top.py) for a model, inside the package.

    data       the model's own batched greedy replies + final hidden states, cached, resumable
    train      fitting the chain of draft steps (hard targets, AdamW, one-cycle schedule)
    evaluate   held-out per-step agreement, expected tau, chain calibration
    recipe     the whole recipe under one time budget, saved with heads.repo.save_heads
    cli        `hf-selfspec train-heads MODEL --out DIR --minutes N`
"""

from .recipe import RecipeConfig, train_top_heads

__all__ = ["RecipeConfig", "train_top_heads"]
