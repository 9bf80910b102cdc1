"""Training exit heads by self-distillation: targets are the model's own greedy tokens.

Two phases, each resumable:

1. `collect_features`: teacher-forced HF forwards (`output_hidden_states=True`) over chat-
   rendered conversations; at every position whose next token belongs to an assistant
   reply, keep the hidden states of the requested layers (fp16) and the model's argmax
   (the target). Stored as safetensors chunks + state.json in a folder (`FeatureStore`).
2. `train_head`: cross-entropy over V_k (+ ⊥ for targets outside V_k) with the LM-head
   rows frozen; AdamW, seeded shuffles, best-on-validation weights kept, a checkpoint
   after every epoch.

`evaluate_head` gives held-out agreement and the (confidence, accepted) pairs that
`Calibration.fit` turns into thresholds.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data import Conversation, render_chat
from .exit import ExitHead

STATE_FILE = "state.json"


# --------------------------------------------------------------------------- features


class FeatureStore:
    """A folder of feature chunks: chunk_NNNNN.safetensors with tensors
    `h{layer}` float16 [n, H] per layer, `targets` int32 [n], `conv` int32 [n]
    (index of the conversation in collection order), and state.json."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)

    @property
    def state(self) -> dict:
        path = self.folder / STATE_FILE
        return json.loads(path.read_text()) if path.is_file() else {}

    def _write_state(self, state: dict) -> None:
        tmp = self.folder / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.folder / STATE_FILE)

    def chunk_paths(self) -> list[Path]:
        return [
            self.folder / f"chunk_{i:05d}.safetensors" for i in range(self.state.get("chunks", 0))
        ]

    @property
    def layers(self) -> list[int]:
        return list(self.state.get("layers", []))

    def __len__(self) -> int:
        return int(self.state.get("positions", 0))

    def load(self, layer: int | None, max_positions: int | None = None):
        """(hidden float16 [N, H] or None, targets int64 [N], conv int64 [N])."""
        from safetensors import safe_open

        if layer is not None and layer not in self.layers:
            raise ValueError(f"{self.folder} has features of layers {self.layers}, not {layer}")
        hs, ts, cs, n = [], [], [], 0
        for path in self.chunk_paths():
            with safe_open(str(path), framework="pt") as f:
                t = f.get_tensor("targets").long()
                take = t.numel() if max_positions is None else min(t.numel(), max_positions - n)
                ts.append(t[:take])
                cs.append(f.get_tensor("conv").long()[:take])
                if layer is not None:
                    hs.append(f.get_tensor(f"h{layer}")[:take])
            n += take
            if max_positions is not None and n >= max_positions:
                break
        if not ts:
            raise ValueError(f"{self.folder} holds no features yet")
        hidden = torch.cat(hs) if layer is not None else None
        return hidden, torch.cat(ts), torch.cat(cs)


@torch.inference_mode()
def collect_features(
    model,
    tokenizer,
    conversations: Iterable[Conversation],
    layers: list[int],
    out_dir: str | os.PathLike,
    *,
    max_positions: int | None = None,
    time_budget_s: float | None = None,
    max_tokens: int = 640,
    chunk_positions: int = 16384,
    autocast_bf16: bool = False,
    progress: bool = True,
) -> FeatureStore:
    """Run teacher-forced forwards and store (hidden states, greedy targets) chunks.

    Resumable: an existing folder with the same settings continues after its last
    complete chunk (the conversation stream must be the same, deterministic one).

    Args:
        layers: hidden_states indices to keep (1 <= layer < num_layers).
        max_positions / time_budget_s: stop after this many positions / seconds of
            collection in this folder, resumed runs included (the chunk in progress is
            written first).
        max_tokens: truncate each rendered conversation to this many tokens.
        autocast_bf16: run the model under CPU/GPU bf16 autocast (about 2x faster on CPUs
            with AMX; the targets then differ from the fp32 argmax at ~1.5% of positions,
            all near-ties). Use fp32 for evaluation and calibration data.
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    store = FeatureStore(out_dir)
    store.folder.mkdir(parents=True, exist_ok=True)
    from hf_selfspec.engine.layered import text_config

    num_layers = text_config(model).num_hidden_layers
    if any(not 1 <= layer < num_layers for layer in layers):
        raise ValueError(f"layers {layers} must be in [1, {num_layers - 1}]")
    settings = {
        "layers": sorted({int(layer) for layer in layers}),
        "max_tokens": max_tokens,
        "autocast_bf16": autocast_bf16,
    }
    state = store.state
    if state and any(state.get(k) != v for k, v in settings.items()):
        raise ValueError(
            f"{store.folder} holds features collected with other settings "
            f"({ {k: state.get(k) for k in settings} }); use another folder"
        )
    if not state:
        state = {
            **settings,
            "conversations_done": 0,
            "positions": 0,
            "chunks": 0,
            "tokens": 0,
            "seconds": 0.0,
        }
        store._write_state(state)
    if max_positions is not None and state["positions"] >= max_positions:
        return store
    if time_budget_s is not None and state["seconds"] >= time_budget_s:
        return store
    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if autocast_bf16 else nullcontext()
    buf_h = {layer: [] for layer in settings["layers"]}
    buf_t, buf_c = [], []
    buffered = 0
    done = state["conversations_done"]
    started = time.perf_counter()
    seconds0 = state["seconds"]
    bar = tqdm(
        total=max_positions,
        initial=state["positions"],
        unit="pos",
        desc="features",
        disable=not progress,
    )

    def flush(conversations_done: int, tokens: int) -> None:
        nonlocal buffered
        if buffered == 0:
            return
        tensors = {f"h{layer}": torch.cat(buf_h[layer]).contiguous() for layer in settings["layers"]}
        tensors["targets"] = torch.cat(buf_t).to(torch.int32)
        tensors["conv"] = torch.cat(buf_c).to(torch.int32)
        save_file(tensors, str(store.folder / f"chunk_{state['chunks']:05d}.safetensors"))
        state["chunks"] += 1
        state["positions"] += buffered
        state["conversations_done"] = conversations_done
        state["tokens"] += tokens
        state["seconds"] = seconds0 + time.perf_counter() - started
        store._write_state(state)
        for v in buf_h.values():
            v.clear()
        buf_t.clear()
        buf_c.clear()
        buffered = 0

    tokens_since_flush = 0
    index = -1
    for index, conversation in enumerate(conversations):
        if index < done:
            continue
        rendered = render_chat(tokenizer, conversation.messages, max_tokens=max_tokens)
        mask = torch.tensor(
            rendered.assistant_mask[1:], dtype=torch.bool
        )  # next token is assistant
        if mask.sum() == 0:
            continue
        ids = torch.tensor([rendered.input_ids], device=device)
        with autocast:
            out = model(ids, output_hidden_states=True, use_cache=False)
        positions = mask.nonzero().squeeze(1).to(device)  # position p predicts token p + 1
        buf_t.append(out.logits[0, positions].argmax(-1).cpu())
        buf_c.append(torch.full((positions.numel(),), index, dtype=torch.int32))
        for layer in settings["layers"]:
            buf_h[layer].append(out.hidden_states[layer][0, positions].to(torch.float16).cpu())
        buffered += positions.numel()
        tokens_since_flush += ids.shape[1]
        bar.update(positions.numel())
        total = state["positions"] + buffered
        out_of_time = (
            time_budget_s is not None and seconds0 + time.perf_counter() - started >= time_budget_s
        )
        if buffered >= chunk_positions or out_of_time or (max_positions and total >= max_positions):
            flush(index + 1, tokens_since_flush)
            tokens_since_flush = 0
            if out_of_time or (max_positions and total >= max_positions):
                break
    else:
        flush(index + 1, tokens_since_flush)
    bar.close()
    return store


# --------------------------------------------------------------------------- vocabulary


def choose_vocab(targets: torch.Tensor, size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent target ids (ties: lower id first) and their target mass.

    Returns (vocab_ids int64 [size'], covered fraction of `targets`); size' <= size when
    fewer distinct targets exist.
    """
    counts = torch.bincount(targets, minlength=vocab_size).double()
    # Stable order: by count descending, then id ascending.
    order = torch.argsort(
        counts * vocab_size - torch.arange(vocab_size, dtype=torch.float64), descending=True
    )
    size = min(size, int((counts > 0).sum()))
    ids = order[:size]
    return ids.sort().values, float(counts[ids].sum() / counts.sum())


def covered_mass(vocab_ids: torch.Tensor, targets: torch.Tensor) -> float:
    return float(torch.isin(targets, vocab_ids.to(targets.device)).float().mean())


def _labels(head: ExitHead, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary targets -> class indices of `head` (⊥ or -100 when outside V_k)."""
    lookup = torch.full(
        (vocab_size,), head.vocab_size if head.reject_class else -100, dtype=torch.long
    )
    lookup[head.vocab_ids.cpu()] = torch.arange(head.vocab_size)
    return lookup[targets.cpu()]


# --------------------------------------------------------------------------- training


@dataclass
class TrainConfig:
    epochs: int = 3
    batch_size: int = 512
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    seed: int = 0
    autocast_bf16: bool = False  # bf16 matmuls in training (CPU AMX / GPU)


@torch.no_grad()
def evaluate_head(
    head: ExitHead, hidden: torch.Tensor, targets: torch.Tensor, batch_size: int = 4096, k: int = 4
) -> dict:
    """Held-out figures of one head.

    Returns a dict: top1, topk (agreement of the model's token with the head's best /
    best k), covered_mass, and tensors `confidence` float32 [N], `correct` bool [N].
    """
    head.eval()
    confs, correct, in_topk = [], [], []
    dtype = head.in_norm.dtype
    for start in range(0, hidden.shape[0], batch_size):
        h = hidden[start : start + batch_size].to(dtype)
        t = targets[start : start + batch_size].to(h.device)
        conf, token = head.propose(h)
        _, tokens = head.topk(h, k)
        confs.append(conf.cpu())
        correct.append((token == t).cpu())
        in_topk.append((tokens == t[:, None]).any(-1).cpu())
    correct_t = torch.cat(correct)
    return {
        "top1": float(correct_t.float().mean()),
        "topk": float(torch.cat(in_topk).float().mean()),
        "covered_mass": covered_mass(head.vocab_ids, targets),
        "confidence": torch.cat(confs),
        "correct": correct_t,
    }


def train_head(
    head: ExitHead,
    train_hidden: torch.Tensor,
    train_targets: torch.Tensor,
    val_hidden: torch.Tensor,
    val_targets: torch.Tensor,
    config: TrainConfig | None = None,
    vocab_size: int | None = None,
    checkpoint: str | os.PathLike | None = None,
    progress: bool = True,
) -> dict:
    """Train `head` (bound, fp32) in place; keep the weights of the best validation epoch.

    Args:
        train_hidden / val_hidden: [N, H] features (any float dtype) of head.layer.
        train_targets / val_targets: int64 [N] full-vocabulary greedy targets.
        vocab_size: full vocabulary size (default: max target + 1).
        checkpoint: file saved after every epoch and resumed from when it exists.
    Returns:
        history dict: per-epoch train loss / val top-1, best epoch, seconds.
    """
    from tqdm.auto import tqdm

    if head.lm_rows is None:
        raise RuntimeError("bind the head to its model before training")
    config = config or TrainConfig()
    vocab_size = vocab_size or int(max(train_targets.max(), val_targets.max())) + 1
    labels = _labels(head, train_targets, vocab_size)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    n = train_hidden.shape[0]
    steps_per_epoch = math.ceil(n / config.batch_size)
    total_steps = steps_per_epoch * config.epochs

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < config.warmup_steps:
            return config.lr * (step + 1) / config.warmup_steps
        progress_ = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
        return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress_))))

    history = {
        "train_loss": [],
        "val_top1": [],
        "best_epoch": -1,
        "best_val_top1": -1.0,
        "seconds": 0.0,
        "config": asdict(config),
    }
    best_state = None
    start_epoch = 0
    if checkpoint is not None and Path(checkpoint).is_file():
        saved = torch.load(checkpoint, weights_only=True)
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        history = saved["history"]
        best_state = saved["best_state"]
        start_epoch = len(history["train_loss"])
    started = time.perf_counter() - history["seconds"]
    device = head.in_norm.device
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if config.autocast_bf16 else nullcontext()
    )
    for epoch in range(start_epoch, config.epochs):
        head.train()
        order = torch.randperm(n, generator=torch.Generator().manual_seed(config.seed + epoch))
        total, count = 0.0, 0
        bar = tqdm(
            range(steps_per_epoch),
            desc=f"layer {head.layer} epoch {epoch + 1}",
            disable=not progress,
            leave=False,
        )
        for i in bar:
            step = epoch * steps_per_epoch + i
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            idx = order[i * config.batch_size : (i + 1) * config.batch_size]
            x = train_hidden[idx].to(device=device, dtype=torch.float32)
            y = labels[idx].to(device)
            with autocast:
                logits = head(x)
            loss = F.cross_entropy(logits.float(), y, ignore_index=-100)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * idx.numel()
            count += idx.numel()
            if i % 20 == 0:
                bar.set_postfix(loss=f"{total / count:.3f}")
        val_top1 = evaluate_head(head, val_hidden, val_targets)["top1"]
        history["train_loss"].append(total / count)
        history["val_top1"].append(val_top1)
        if val_top1 > history["best_val_top1"]:
            history["best_val_top1"], history["best_epoch"] = val_top1, epoch
            best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
        history["seconds"] = time.perf_counter() - started
        if progress:
            print(
                f"layer {head.layer} epoch {epoch + 1}: train loss {total / count:.4f}, "
                f"val top-1 {val_top1:.4f}"
            )
        if checkpoint is not None:
            tmp = Path(str(checkpoint) + ".tmp")
            torch.save(
                {
                    "head": head.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "history": history,
                    "best_state": best_state,
                },
                tmp,
            )
            tmp.replace(checkpoint)
    if best_state is not None:
        head.load_state_dict(best_state)
    head.eval()
    return history
