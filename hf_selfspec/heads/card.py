"""The model card (README.md) of a heads repo, for every head kind, via huggingface_hub.

Metadata is a `ModelCardData` (base_model, base_model_relation "adapter", library_name,
license, tags, datasets, and an `hf_selfspec` block of measured figures); the body is the
kind's Jinja template in hf_selfspec/model_cards/, filled from config.json's `training`.
What differs by kind is one `CardForm`, which the kind table (kinds.py) names per kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LIBRARY_NAME = "hf_selfspec"
TEMPLATES = Path(__file__).resolve().parent.parent / "model_cards"
COMMON_TAGS = ["hf_selfspec", "self-speculative-decoding", "speculative-decoding"]
# The shipped top-layer heads' training prompts; heads that record their own say so.
DEFAULT_TOP_DATASETS = ["anon8231489123/ShareGPT_Vicuna_unfiltered"]
DEFAULT_REPRODUCE = "scripts/head_study.py (see docs/head_study.md)"


@dataclass(frozen=True)
class CardForm:
    """One kind's card: its template in model_cards/, its tags, and what fills the template
    (heads -> (Hub datasets, the metadata's summary figures, the template's variables))."""

    template: str
    tags: tuple[str, ...]
    context: Callable[[Any], tuple[list, dict, dict]]


def render(heads, form: CardForm) -> str:
    """README.md text of `heads` in the card `form` of their kind: YAML metadata + body."""
    import jinja2
    from huggingface_hub import ModelCard, ModelCardData

    kind = heads.kind
    config, training = heads.config, dict(heads.config.training or {})
    datasets, summary, context = form.context(heads)
    data = ModelCardData(
        base_model=config.base_model,
        base_model_relation="adapter",
        library_name=LIBRARY_NAME,
        license=training.get("license", "apache-2.0"),
        tags=COMMON_TAGS + list(form.tags),
        datasets=list(datasets) or None,  # user prompts: no Hub dataset to name
        hf_selfspec={"kind": kind, "format_version": config.format_version, **summary},
    )
    template = jinja2.Template(
        (TEMPLATES / form.template).read_text(encoding="utf-8"),
        keep_trailing_newline=True,
        undefined=jinja2.ChainableUndefined,  # a figure missing from `training` prints as empty
    )
    text = template.render(card_data=data.to_yaml(), config=config, training=training, **context)
    return str(ModelCard(text))  # parses the metadata back: a card the Hub can read


def _exit_context(heads) -> tuple[list, dict, dict]:
    config, training = heads.config, dict(heads.config.training or {})
    metrics = training.get("heads") or [{} for _ in heads.heads]
    thresholds = heads.calibration.thresholds if heads.calibration else [None] * len(heads)
    rows = []
    for i, head in enumerate(heads.heads):
        m = dict(metrics[i]) if i < len(metrics) else {}
        m.update(layer=head.layer, vocab_size=head.vocab_size, adapter_dim=head.adapter_dim,
                 threshold=thresholds[i])
        if heads.calibration is not None:
            m.setdefault("min_accept", heads.calibration.heads[i].min_accept)
        rows.append(m)
    summary = {
        "layers": list(config.layers),
        "top1_agreement": [r.get("eval_top1") for r in rows],
        "covered_target_mass": [r.get("covered_mass_eval") for r in rows],
        "training_positions": training.get("train_positions"),
        "training_time_s": training.get("total_time_s"),
    }
    return training.get("datasets", []), summary, {"heads": rows, "fmt": _fmt}


def _top_context(heads) -> tuple[list, dict, dict]:
    cfg, t = heads.config, dict(heads.config.training or {})
    # the decoder's own text (own_eval_*) where measured, else the teacher-forced eval
    prefix = "own_eval_" if "own_eval_step0_top1_given_reached" in t else ""
    summary = {
        "depth": cfg.depth,
        "top1_agreement_per_step": [
            t.get(f"{prefix}step{i}_top1_given_reached") for i in range(cfg.depth)],
        "expected_tau_full_chain": t.get(prefix + "tau_thr0.0"),  # all `depth` drafts
        "training_positions": t.get("train_positions"),
    }
    _, held_out = _prompt_words(t)
    evals = [("", ("held-out ShareGPT conversations, teacher-forced, positions where the text "
                   "is the model's own greedy continuation"))]
    if prefix:
        evals.insert(0, (prefix, (f"the model's own greedy replies to {held_out} (the text "
                                  "the decoder sees)")))
    tables = [
        {"what": what, "tau": t.get(pre + "tau_thr0.0"), "tau_02": t.get(pre + "tau_thr0.2"),
         "rows": [{"step": i, "top1": t.get(f"{pre}step{i}_top1_given_reached"),
                   "top4": t.get(f"{pre}step{i}_top4_given_reached")} for i in range(cfg.depth)]}
        for pre, what in evals if f"{pre}step0_top1_given_reached" in t
    ]
    return t.get("datasets", DEFAULT_TOP_DATASETS), summary, {
        "evals": tables,
        "tree": t.get("own_eval_dynamic_tree_tau"),  # scripts/head_study.py dyn-trees
        "e2e": t.get("end_to_end"),  # generate(assistant="self") vs HF greedy, scripts/bench.py
        "training_text": _training_text(t),
        "reproduce": t.get("reproduce", DEFAULT_REPRODUCE),
    }


EXIT_CARD = CardForm("heads_card.md.j2", ("early-exit", "exit-heads"), _exit_context)
TOP_CARD = CardForm("top_heads_card.md.j2", ("draft-heads",), _top_context)


def _training_text(t: dict) -> str:
    """Where the heads' training data came from, in words, from config.training (a chain of
    fine-tunings is described newest first, down to the heads trained from scratch)."""
    tf = "teacher-forced positions of the ShareGPT train split"
    parts = []
    while t:
        own = f"positions of the model's own batched greedy replies to {_prompt_words(t)[0]}"
        data = {"own": own, "both": f"{tf} and {own}"}.get(t.get("data"), tf)
        what = (f"{t.get('train_positions')} {data}, {t.get('epochs')} epochs, "
                f"{t.get('train_seconds')} s")
        if t.get("new_steps_only"):
            what = f"the added steps alone (earlier steps frozen) on {what}"
        parts.append(what)
        t = t.get("init_training") or {}
    if not parts:
        return "not recorded in config.json"
    return parts[0] + "".join(f"; fine-tuned from heads trained on {p}" for p in parts[1:])


def _prompt_words(t: dict) -> tuple[str, str]:
    """(training prompts, held-out prompts) in words, from config.training's `prompts`:
    "sharegpt" (or absent: the shipped heads) or the file `hf-selfspec train-heads --prompts`
    was given (named by its file name; the Reproduce command has the full path)."""
    source = t.get("prompts")
    if source in (None, "sharegpt"):
        return "ShareGPT train prompts", "held-out ShareGPT prompts"
    name = Path(str(source)).name
    return (f"the user's own prompts (`{name}`, --prompts)",
            f"held-out prompts of the user's `{name}` (not trained on)")


def _fmt(value, digits: int = 3) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)
