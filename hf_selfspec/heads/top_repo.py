"""Save / load top-draft heads in the same Hub repo layout as exit heads.

    config.json        TopHeadsConfig (kind "top_draft", base model + fingerprint, sizes)
    heads.safetensors  step weights, out norm and vocab ids (LM-head rows and embeddings
                       are the base model's, gathered at bind time)
    calibration.json   per-step confidence thresholds
    README.md          model card
"""

from __future__ import annotations

import json
from pathlib import Path

from .top import STORAGE_DTYPES, TOP_KIND, TopDraftHeads, TopHeadsConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "heads.safetensors"
CALIBRATION_FILE = "calibration.json"


class TopCalibration:
    """Per-step thresholds: draft step i only when its confidence >= thresholds[i]."""

    def __init__(self, thresholds: list[float]):
        self.thresholds = [float(t) for t in thresholds]

    def accept_prob(self, index, confidence):
        return confidence  # uncalibrated: the confidence itself

    def to_dict(self) -> dict:
        return {"kind": TOP_KIND, "thresholds": self.thresholds,
                "rule": "draft step i when its confidence >= thresholds[i]"}


def read_kind(folder: Path) -> str:
    path = Path(folder) / CONFIG_FILE
    try:
        return json.loads(path.read_text()).get("kind", "exit_head")
    except (OSError, json.JSONDecodeError):
        return "exit_head"  # let the exit-head loader report the problem


DEFAULT_REPRODUCE = (
    "python scripts/head_study.py collect --seconds 660 && python scripts/head_study.py collect "
    "--part 1 --seconds 600 && python scripts/head_study.py train --epochs 3 --batch 512 "
    "--out hf_selfspec/default_heads")


def _training_text(t: dict) -> str:
    """Where the heads' training data came from, in words, from config.training (a chain of
    fine-tunings is described newest first, down to the heads trained from scratch)."""
    own = "positions of the model's own batched greedy replies to ShareGPT train prompts"
    tf = "teacher-forced positions of the ShareGPT train split"
    parts = []
    while t:
        data = {"own": own, "both": f"{tf} and {own}"}.get(t.get("data"), tf)
        what = f"{t.get('train_positions')} {data}, {t.get('epochs')} epochs, {t.get('train_seconds')} s"
        if t.get("new_steps_only"):
            what = f"the added steps alone (earlier steps frozen) on {what}"
        parts.append(what)
        t = t.get("init_training") or {}
    if not parts:
        return "not recorded in config.json"
    text = parts[0] + "".join(f"; fine-tuned from heads trained on {p}" for p in parts[1:])
    return text + " on a 2-core CPU"


def render_top_card(heads: TopDraftHeads) -> str:
    """README.md model card: YAML metadata + the measured figures stored in config.training."""
    cfg = heads.config
    t = cfg.training or {}
    # the decoder's own text (own_eval_*) where measured, else the teacher-forced eval
    prefix = "own_eval_" if "own_eval_step0_top1_given_reached" in t else ""
    steps = [t.get(f"{prefix}step{i}_top1_given_reached") for i in range(cfg.depth)]
    meta = [
        "---",
        f"base_model: {cfg.base_model}",
        "library_name: hf_selfspec",
        "license: apache-2.0",
        "tags:", "- hf_selfspec", "- self-speculative-decoding", "- speculative-decoding",
        "- draft-heads",
        "datasets:", "- anon8231489123/ShareGPT_Vicuna_unfiltered",
        "hf_selfspec:",
        f"  kind: {TOP_KIND}",
        f"  depth: {cfg.depth}",
        f"  top1_agreement_per_step: {steps}",
        f"  expected_tau_full_chain: {t.get(prefix + 'tau_thr0.0')}",  # all `depth` drafts
        f"  training_positions: {t.get('train_positions')}",
        "---", "",
    ]
    evals = [("", "held-out ShareGPT conversations, teacher-forced, positions where the text is the model's own greedy continuation")]
    if prefix:
        evals.insert(0, (prefix, "the model's own greedy replies to held-out ShareGPT prompts (the text the decoder sees)"))
    tables = []
    for pre, what in evals:
        if f"{pre}step0_top1_given_reached" not in t:
            continue
        rows = "\n".join(
            f"| {i} | {t.get(f'{pre}step{i}_top1_given_reached')} | {t.get(f'{pre}step{i}_top4_given_reached')} |"
            for i in range(cfg.depth))
        tables.append(f"""## Measured on {what}

| step | top-1 (given the previous draft was right) | top-4 |
|---|---|---|
{rows}

Expected tokens per verification with {cfg.depth} drafts: {t.get(pre + 'tau_thr0.0')}
(thresholds 0.2: {t.get(pre + 'tau_thr0.2')}).
""")
    tree = t.get("own_eval_dynamic_tree_tau")
    if tree:  # scripts/head_study.py dyn-trees: the decoder's default draft structure
        tables.append(
            "## Their dynamic draft tree on the same replies\n\n"
            f"The {tree.get('beam')} likeliest nodes of each step expanded by their {tree.get('children')} "
            "likeliest next tokens, the N likeliest nodes kept (what the decoder drafts):\n\n"
            "| drafts N | tokens per verification (tree) | chain of N |\n|---|---|---|\n"
            + "\n".join(f"| {n} | {v} | {tree.get('chain', {}).get(n, '-')} |" for n, v in tree["tree"].items())
            + "\n")
    e2e = t.get("end_to_end")
    if e2e:  # generate(assistant="self") vs HF greedy, as measured by scripts/bench.py
        tables.append(
            f"## End to end ({e2e.get('setup')})\n\n| prompts | tau | speed vs HF greedy |\n|---|---|---|\n"
            + "\n".join(f"| {k} | {v['tau']} | {v['speedup']}x |" for k, v in e2e.get("rows", {}).items())
            + f"\n\nReproduce: `{e2e.get('command')}`.\n")
    measured = "\n".join(tables)
    body = f"""# Top-layer draft heads for {cfg.base_model}

Draft heads for the `hf_selfspec` library. After each verification they chain {cfg.depth}
drafts from the model's last final hidden state and the committed token (a small MLP per
step over [state; token embedding] and the frozen LM-head rows of {cfg.reduced_vocab} tokens),
with no decoder-layer pass; the model verifies every draft, so greedy output is identical to
the model's own.

```python
import hf_selfspec
hf_selfspec.attach_heads(model, heads="<this repo>")
out = model.generate(**inputs, assistant="self")
```

{measured}
Drafting cost: {t.get('draft_cost_in_steps')} of a full step for all {cfg.depth} drafts.
Training: {_training_text(t)}. Reproduce: `{t.get('reproduce', DEFAULT_REPRODUCE)}`.
"""
    return "\n".join(meta) + body


def save_top_heads(heads: TopDraftHeads, folder, thresholds: list[float] | None = None) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}
    stored = STORAGE_DTYPES[heads.config.storage_dtype]
    state = {k: v.to(stored) if v.is_floating_point() else v for k, v in state.items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt", "kind": TOP_KIND})
    (folder / CONFIG_FILE).write_text(json.dumps(heads.config.to_dict(), indent=2) + "\n")
    if thresholds is None:
        thresholds = heads.calibration.thresholds if heads.calibration else [0.0] * heads.config.depth
    (folder / CALIBRATION_FILE).write_text(json.dumps(TopCalibration(thresholds).to_dict(), indent=2) + "\n")
    (folder / "README.md").write_text(render_top_card(heads), encoding="utf-8")
    return folder


def check_top_compatible(config: TopHeadsConfig, model) -> None:
    """ValueError unless `model` has the weights the heads were trained for."""
    from .repo import fingerprint

    if fingerprint(model) != config.base_fingerprint:
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        raise ValueError(
            f"These heads are for '{config.base_model}' (fingerprint {config.base_fingerprint[:12]}), "
            f"but the model '{name}' has other weights (fingerprint {fingerprint(model)[:12]}). "
            "Load them with the model they were trained for, or train heads for this model "
            "(python scripts/head_study.py collect/train)."
        )


def load_top_heads(folder, model=None) -> TopDraftHeads:
    from safetensors.torch import load_file

    folder = Path(folder)
    for name in (CONFIG_FILE, WEIGHTS_FILE, CALIBRATION_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing: a heads folder needs "
                                    f"{CONFIG_FILE}, {WEIGHTS_FILE}, {CALIBRATION_FILE}")
    try:
        config = TopHeadsConfig.from_dict(json.loads((folder / CONFIG_FILE).read_text()))
        calibration = json.loads((folder / CALIBRATION_FILE).read_text())
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{folder}: bad config.json or calibration.json: {e}") from None
    if model is not None:
        check_top_compatible(config, model)
    try:
        state = load_file(str(folder / WEIGHTS_FILE))
    except Exception as e:
        raise ValueError(f"{folder / WEIGHTS_FILE} is corrupt or truncated ({e}); save the heads again") from None
    heads = TopDraftHeads(config, state.get("vocab_ids"))
    try:
        heads.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{folder / WEIGHTS_FILE} does not match {folder / CONFIG_FILE}: {e}") from None
    thresholds = calibration.get("thresholds", [0.0] * config.depth)
    if len(thresholds) != config.depth:
        raise ValueError(f"{folder / CALIBRATION_FILE} has {len(thresholds)} thresholds for depth {config.depth}")
    heads.calibration = TopCalibration(thresholds)
    if model is not None:
        heads.bind(model)
    return heads


__all__ = ["TopCalibration", "check_top_compatible", "load_top_heads", "read_kind", "save_top_heads"]
