"""The heads repo format: a normal Hugging Face Hub model repo (or a local folder).

    config.json         HeadsConfig: base model id + fingerprint, layers, sizes, version
    heads.safetensors   head weights (never pickle); LM-head rows are NOT stored
    calibration.json    per-head confidence -> P(accept) maps and thresholds
    README.md           model card (YAML metadata + measured agreement), from
                        hf_selfspec/model_cards/heads_card.md.j2

Loading heads made for another base model is an error that names both models, never a
silent slowdown: `fingerprint(model)` hashes the model's dimensions and a fixed sample
of its weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from .calibrate import Calibration
from .kinds import ExitHeads, HeadsConfig, final_norm, lm_head_weight

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "heads.safetensors"
CALIBRATION_FILE = "calibration.json"
CARD_FILE = "README.md"
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE, CALIBRATION_FILE)
CARD_TEMPLATE = Path(__file__).resolve().parent.parent / "model_cards" / "heads_card.md.j2"

# Weight sample of the fingerprint: these many leading values of the first row of each
# sampled matrix, from this many evenly spaced embedding rows and three decoder layers.
_PROBE_VALUES = 16
_PROBE_EMBED_ROWS = 8


def default_heads_path() -> Path:
    """The heads `attach_heads(model)` uses for the embedded default model
    (SmolLM2-135M-Instruct): the measured best design, top-layer draft heads."""
    return Path(__file__).resolve().parent.parent / "default_heads"


def exit_heads_path() -> Path:
    """Exit heads (layers 2/10/24) shipped for the embedded default model, the
    position-wise alternative: `attach_heads(model, heads=exit_heads_path())`."""
    return Path(__file__).resolve().parent.parent / "exit_heads"


# --------------------------------------------------------------------------- fingerprint


def _model_dims(model) -> dict:
    cfg = model.config
    return {
        "model_type": getattr(cfg, "model_type", type(model).__name__),
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": getattr(cfg, "intermediate_size", None),
        "num_attention_heads": getattr(cfg, "num_attention_heads", None),
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None),
        "vocab_size": int(lm_head_weight(model).shape[0]),
    }


@torch.no_grad()
def _probe_tensor(model) -> torch.Tensor:
    """A deterministic sample of weights, float32 [P]: embedding rows, 3 layers, final norm."""
    parts = []
    embed = model.get_input_embeddings().weight
    rows = torch.linspace(0, embed.shape[0] - 1, _PROBE_EMBED_ROWS).long()
    parts.append(embed[rows.to(embed.device), :_PROBE_VALUES].reshape(-1))
    layers = model.model.layers
    for i in sorted({0, len(layers) // 2, len(layers) - 1}):
        for _name, p in layers[i].named_parameters():
            if p.ndim == 2:
                parts.append(p[0, :_PROBE_VALUES])
    parts.append(final_norm(model).weight[:_PROBE_VALUES])
    return torch.cat([p.detach().float().cpu() for p in parts])


def weight_probe(model) -> list[float]:
    """The fingerprint's weight sample as floats (stored in config.json)."""
    return [float(f"{v:.6g}") for v in _probe_tensor(model).tolist()]


def fingerprint(model) -> str:
    """sha256 hex over the model's dimensions and a fixed sample of its weights.

    Weights are rounded to bfloat16 first, so the fp32 and bf16 loads of one checkpoint
    share a fingerprint. Cost: a few hundred values copied to the CPU (well under 50 ms).
    """
    h = hashlib.sha256(json.dumps(_model_dims(model), sort_keys=True).encode())
    probe = _probe_tensor(model).to(torch.bfloat16).view(torch.int16).numpy()
    h.update(probe.tobytes())
    return h.hexdigest()


def _model_name(model) -> str:
    return getattr(model.config, "_name_or_path", "") or type(model).__name__


def check_compatible(config: HeadsConfig, model) -> None:
    """ValueError unless `model` is the base model the heads were trained for.

    Accepted: an equal fingerprint, or equal dimensions and a weight sample equal within
    2% (the same checkpoint in fp16 or another rounding).
    """
    dims = _model_dims(model)
    wanted = {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
    }
    advice = (
        f"Load the heads with the model they were trained for ('{config.base_model}'), "
        f"or train heads for this model: python scripts/train_heads.py --model <model> --out <folder>"
    )
    for key, value in wanted.items():
        if dims[key] != value:
            raise ValueError(
                f"These heads are for '{config.base_model}' ({key}={value}), but the model "
                f"'{_model_name(model)}' has {key}={dims[key]}. {advice}"
            )
    if fingerprint(model) == config.base_fingerprint:
        return
    probe = _probe_tensor(model).numpy()
    stored = np.asarray(config.base_probe, dtype=np.float32)
    if stored.shape == probe.shape and np.allclose(
        probe, stored, rtol=2e-2, atol=2e-3 * max(float(np.abs(stored).max()), 1e-6)
    ):
        return
    raise ValueError(
        f"These heads are for '{config.base_model}' (fingerprint {config.base_fingerprint[:12]}), "
        f"but the model '{_model_name(model)}' has other weights (fingerprint "
        f"{fingerprint(model)[:12]}). {advice}"
    )


# --------------------------------------------------------------------------- model card


def render_card(heads: ExitHeads) -> str:
    """README.md text: YAML metadata + a table of measured per-head figures."""
    import jinja2
    import yaml

    config, training = heads.config, dict(heads.config.training)
    metrics = training.get("heads") or [{} for _ in heads.heads]
    thresholds = heads.calibration.thresholds if heads.calibration else [None] * len(heads)
    rows = []
    for i, head in enumerate(heads.heads):
        m = dict(metrics[i]) if i < len(metrics) else {}
        m.update(
            layer=head.layer,
            vocab_size=head.vocab_size,
            adapter_dim=head.adapter_dim,
            threshold=thresholds[i],
        )
        if heads.calibration is not None:
            m.setdefault("min_accept", heads.calibration.heads[i].min_accept)
        rows.append(m)
    metadata = {
        "base_model": config.base_model,
        "library_name": "hf_selfspec",
        "license": training.get("license", "apache-2.0"),
        "tags": [
            "hf_selfspec",
            "self-speculative-decoding",
            "speculative-decoding",
            "early-exit",
            "exit-heads",
        ],
        "datasets": training.get("datasets", []),
        "hf_selfspec": {
            "kind": config.kind,
            "format_version": config.format_version,
            "layers": list(config.layers),
            "top1_agreement": [r.get("eval_top1") for r in rows],
            "covered_target_mass": [r.get("covered_mass_eval") for r in rows],
            "training_positions": training.get("train_positions"),
            "training_time_s": training.get("total_time_s"),
        },
    }
    template = jinja2.Template(
        CARD_TEMPLATE.read_text(encoding="utf-8"),
        keep_trailing_newline=True,
        undefined=jinja2.ChainableUndefined,
    )
    return template.render(
        yaml=yaml.safe_dump(metadata, sort_keys=False, allow_unicode=True).strip(),
        config=config,
        training=training,
        heads=rows,
        fmt=_fmt,
    )


def _fmt(value, digits: int = 3) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


# --------------------------------------------------------------------------- save / load


def save_heads(heads: ExitHeads, folder: str | os.PathLike, card: bool = True) -> Path:
    """Write config.json, heads.safetensors, calibration.json (and README.md) to `folder`.

    Heads without a calibration get the identity map with threshold 0.6 (labelled so).
    """
    from safetensors.torch import save

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    heads.config.validate()
    if heads.calibration is None:
        heads.calibration = Calibration.uncalibrated(len(heads))
    state = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    # Float weights in fp32 whatever the model's dtype, so a file does not depend on it.
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    # save() + write_bytes rather than save_file: ordinary (umask) file permissions.
    (folder / WEIGHTS_FILE).write_bytes(
        save(
            state,
            metadata={
                "format": "pt",
                "hf_selfspec_format_version": str(heads.config.format_version),
            },
        )
    )
    (folder / CONFIG_FILE).write_text(json.dumps(heads.config.to_dict(), indent=2) + "\n")
    (folder / CALIBRATION_FILE).write_text(json.dumps(heads.calibration.to_dict(), indent=2) + "\n")
    if card:
        (folder / CARD_FILE).write_text(render_card(heads), encoding="utf-8")
    return folder


def _resolve(source, revision, cache_dir, token, local_files_only) -> Path:
    path = Path(os.fspath(source)).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(source).startswith((".", "/", "~")) or str(source).count("/") > 1:
        raise FileNotFoundError(f"heads folder {path} does not exist (or is not a folder)")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id=str(source),
                revision=revision,
                cache_dir=cache_dir,
                token=token,
                local_files_only=local_files_only,
                allow_patterns=[*REQUIRED_FILES, CARD_FILE],
            )
        )
    except Exception as e:  # network, auth, not in the offline cache, ...
        raise OSError(
            f"could not get heads '{source}': not a local folder, and the Hub (or, offline, "
            f"the local cache) gave {type(e).__name__}: {e}"
        ) from e


def resolve_heads_folder(source, revision: str | None = None) -> Path:
    """A local heads folder for `source`: the folder itself, or the Hub snapshot of a repo
    id (honours HF_HUB_OFFLINE and the local cache)."""
    return _resolve(source, revision, None, None, False)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: a heads folder needs {', '.join(REQUIRED_FILES)}"
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def load_heads(
    source,
    model=None,
    *,
    revision: str | None = None,
    cache_dir=None,
    token: str | bool | None = None,
    local_files_only: bool = False,
) -> ExitHeads:
    """Load heads from a local folder or a Hub repo id, check them against `model`, bind.

    Args:
        source: folder path or Hub repo id ("org/name"). Hub downloads honour
            HF_HUB_OFFLINE and the local cache (`cache_dir`, `local_files_only`).
        model: the base HF model; None loads without checking or binding (inspection).
    Raises:
        FileNotFoundError / OSError: missing folder, files, or Hub repo.
        ValueError: corrupt files, unsupported format, or heads for another model.
    """
    from safetensors.torch import load_file

    folder = _resolve(source, revision, cache_dir, token, local_files_only)
    config_path = folder / CONFIG_FILE
    try:
        config = HeadsConfig.from_dict(_read_json(config_path))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{config_path}: {e}") from None
    calib_path = folder / CALIBRATION_FILE
    try:
        calibration = Calibration.from_dict(_read_json(calib_path))
    except ValueError as e:
        raise ValueError(f"{calib_path}: {e}") from None
    if len(calibration.heads) != len(config.layers):
        raise ValueError(
            f"{calib_path} calibrates {len(calibration.heads)} heads, "
            f"{config_path} declares {len(config.layers)}"
        )
    if model is not None:
        check_compatible(config, model)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise FileNotFoundError(
            f"{weights_path} is missing: a heads folder needs {', '.join(REQUIRED_FILES)}"
        )
    try:
        state = load_file(str(weights_path))
    except Exception as e:  # noqa: BLE001 (SafetensorError: truncated header, bad offsets; OSError)
        raise ValueError(
            f"{weights_path} is corrupt or truncated ({e}); download or save the heads again"
        ) from None
    heads = ExitHeads(config)
    try:
        heads.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{weights_path} does not match {config_path}: {e}") from None
    heads.calibration = calibration
    if model is not None:
        heads.bind(model)
    return heads


def push_heads(
    folder,
    repo_id: str,
    token: str | None = None,
    private: bool = False,
    commit_message: str = "Upload hf_selfspec exit heads",
):
    """Upload a saved heads folder to the Hub as a model repo (created if needed)."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    for name in REQUIRED_FILES:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing: save_heads() the heads first")
    HeadsConfig.from_dict(_read_json(folder / CONFIG_FILE))  # refuse to push a bad config
    api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    return api.upload_folder(
        folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message=commit_message
    )
