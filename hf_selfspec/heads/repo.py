"""The heads repo format, for every head kind: a normal Hugging Face Hub model repo (or a
local folder).

    config.json         the kind's config ("kind" says which: an entry of kinds.KINDS):
                        base model id, fingerprint and weight probe, sizes, format version
    heads.safetensors   head weights (never pickle); the base model's LM-head rows and
                        embeddings are NOT stored, they are gathered at bind time
    calibration.json    per head (exit heads) or per chain step (top-layer heads): thresholds
    README.md           model card (card.render_card)

Heads files are untrusted input. `load_heads` checks, in this order and before it
allocates anything: every config.json and calibration.json field (type, shape, range),
the config against the base model (base.check_compatible), and the shapes and dtypes of
the safetensors header against the config; then the vocabulary ids (1-D, unique, in
[0, vocab)). Every error is a ValueError (FileNotFoundError / OSError for missing files)
that names the file and the field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .base import check_compatible, fingerprint, weight_probe
from .exit import HEAD_KIND
from .kinds import HeadKind, kind_named, kind_of, render_card

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "heads.safetensors"
CALIBRATION_FILE = "calibration.json"
CARD_FILE = "README.md"
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE, CALIBRATION_FILE)
HUB_FILES = (*REQUIRED_FILES, CARD_FILE)  # what is downloaded and uploaded, nothing else
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64"}


def default_heads_path() -> Path:
    """The heads `attach_heads(model)` uses for the embedded default model
    (SmolLM2-135M-Instruct): the measured best design, top-layer draft heads."""
    return Path(__file__).resolve().parent.parent / "default_heads"


def exit_heads_path() -> Path:
    """Exit heads (layers 2/10/24) shipped for the embedded default model, the
    position-wise alternative: `attach_heads(model, heads=exit_heads_path())`."""
    return Path(__file__).resolve().parent.parent / "exit_heads"


# --------------------------------------------------------------------------- locate


def names_a_local_path(value) -> bool:
    """Whether `value` can only mean a local path, never a Hub id ORG/NAME: it exists (as a
    file or folder), starts with ".", "/" or "~", or holds more than one "/"."""
    text = os.fspath(value)
    return Path(text).expanduser().exists() or text.startswith((".", "/", "~")) or text.count("/") > 1


def resolve_heads_folder(source, revision: str | None = None, *, cache_dir=None,
                         token: str | bool | None = None, local_files_only: bool = False) -> Path:
    """A local heads folder for `source`: the folder itself, or the Hub snapshot of a repo
    id (huggingface_hub.snapshot_download: honours HF_HUB_OFFLINE and the local cache)."""
    path = Path(os.fspath(source)).expanduser()
    if path.is_dir():
        return path
    if names_a_local_path(source):
        raise FileNotFoundError(f"heads folder {path} does not exist (or is not a folder)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(
            repo_id=str(source), revision=revision, cache_dir=cache_dir, token=token,
            local_files_only=local_files_only, allow_patterns=list(HUB_FILES)))
    except Exception as e:
        raise OSError(
            f"could not get heads '{source}': not a local folder, and the Hub (or, offline, "
            f"the local cache) gave {type(e).__name__}: {e}"
        ) from e


def _read_json(path: Path):
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a heads folder needs {', '.join(REQUIRED_FILES)}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:  # json's decoder recurses per nesting level: "[[[[...]]]]"
        raise ValueError(f"{path} is not a heads file: its JSON is nested too deeply") from None


def read_kind(folder) -> str:
    """The kind config.json names ("exit_head" when it names none or cannot be read: the
    loader then reports what is wrong with it)."""
    try:
        data = json.loads((Path(folder) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return HEAD_KIND
    kind = data.get("kind", HEAD_KIND) if isinstance(data, dict) else HEAD_KIND
    return kind if isinstance(kind, str) else HEAD_KIND


def _kind_of(data, path: Path) -> HeadKind:
    if not isinstance(data, dict):  # a bad file: ValueError like every other
        raise ValueError(  # noqa: TRY004
            f"{path}: a heads config must be a JSON object, got a JSON {type(data).__name__}")
    try:
        return kind_named(data.get("kind", HEAD_KIND))  # (no "kind": the first kind's files)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def read_config(folder):
    """(HeadKind, validated config) of a heads folder; ValueError naming file and field."""
    path = Path(folder) / CONFIG_FILE
    data = _read_json(path)
    kind = _kind_of(data, path)
    try:
        return kind, kind.config.from_dict(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


# --------------------------------------------------------------------------- load


def load_heads(source, model=None, *, kind: str | None = None, revision: str | None = None,
               cache_dir=None, token: str | bool | None = None, local_files_only: bool = False):
    """Load heads of any kind from a local folder or a Hub repo id, check them against
    `model`, bind them to it.

    Args:
        source: folder path or Hub repo id ("org/name"); revision, cache_dir, token and
            local_files_only go to huggingface_hub.snapshot_download.
        model: the base HF model; None loads without checking or binding (inspection).
        kind: refuse heads of another kind ("top_draft", say) before anything else is read.
    Returns:
        ExitHeads or TopDraftHeads, as config.json's "kind" says.
    Raises:
        FileNotFoundError / OSError: missing folder, files, or Hub repo.
        ValueError: malformed files (naming the file and field), an unsupported format, or
            heads for another model. A near-identical checkpoint warns instead
            (base.HeadsMismatchWarning).
    """
    folder = resolve_heads_folder(source, revision, cache_dir=cache_dir, token=token,
                                  local_files_only=local_files_only)
    for name in REQUIRED_FILES:
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"{folder / name} is missing: a heads folder needs {', '.join(REQUIRED_FILES)}")
    wanted = kind
    kind, config = read_config(folder)
    if wanted is not None and kind.name != wanted:
        raise ValueError(f"{folder / CONFIG_FILE}: field 'kind' is {kind.name!r}, not {wanted!r}")
    calib_path = folder / CALIBRATION_FILE
    calibration_data = _read_json(calib_path)  # its errors name the file already
    try:
        calibration = kind.read_calibration(calibration_data, config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{calib_path}: {e}") from None
    if model is not None:
        try:
            check_compatible(config, model)  # sizes are the model's own from here on
        except ValueError as e:
            raise ValueError(f"{folder / CONFIG_FILE}: {e}") from None
        if not config.base_probe and fingerprint(model) == config.base_fingerprint:
            # heads saved before the probe existed, on their own model: record it, so that
            # a re-save (a fine-tune, say) can tell how far another checkpoint is
            config.base_probe = weight_probe(model)
    state = _read_weights(folder / WEIGHTS_FILE, kind, config)
    heads = kind.module(config)
    heads.load_state_dict(state, strict=True)  # keys, shapes and dtypes checked above
    heads.calibration = calibration
    if model is not None:
        heads.bind(model)
    return heads


def _expected_state(kind: HeadKind, config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor the config implies, from a skeleton on the
    meta device (nothing is allocated)."""
    with torch.device("meta"):
        skeleton = kind.module(config)
    floats = kind.weights_dtype(config)
    return {k: (tuple(v.shape), floats if v.is_floating_point() else v.dtype)
            for k, v in skeleton.state_dict().items()}


def _read_weights(path: Path, kind: HeadKind, config) -> dict[str, torch.Tensor]:
    """The tensors of heads.safetensors, after their header agrees with the config (names,
    shapes, dtypes) and before the module is built; then finite floats and valid ids."""
    from safetensors import safe_open

    expected = _expected_state(kind, config)
    try:
        with safe_open(str(path), framework="pt") as f:
            header = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                      for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
            where = f"{path} does not match {path.parent / CONFIG_FILE}"
            missing = sorted(expected.keys() - header.keys())
            extra = sorted(header.keys() - expected.keys())
            if missing or extra:
                raise _Mismatch(f"{where}: missing tensors {missing}, unexpected tensors {extra}")
            for name, (shape, dtype) in expected.items():
                found_shape, found_dtype = header[name]
                if found_shape != shape:
                    raise _Mismatch(f"{where}: tensor {name!r} has shape {list(found_shape)}, "
                                    f"the config implies {list(shape)}")
                if found_dtype != _SAFETENSORS_DTYPES[dtype]:
                    raise _Mismatch(f"{where}: tensor {name!r} has dtype {found_dtype}, "
                                    f"the config implies {_SAFETENSORS_DTYPES[dtype]}")
            state = {k: f.get_tensor(k) for k in expected}
    except _Mismatch as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # noqa: BLE001 (SafetensorError: truncated header, bad offsets; OSError)
        raise ValueError(
            f"{path} is corrupt or truncated ({e}); download or save the heads again") from None
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{path}: tensor {name!r} holds NaN or infinite values")
        if name.endswith("vocab_ids"):
            _check_vocab_ids(path, name, tensor, config.vocab_size)
    return state


class _Mismatch(Exception):
    """The safetensors header disagrees with the config (reported as a ValueError)."""


def _check_vocab_ids(path: Path, name: str, ids: torch.Tensor, vocab_size: int) -> None:
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError(f"{path}: tensor {name!r} must be a non-empty 1-D list of token ids")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{path}: tensor {name!r} holds token id {low if low < 0 else high}, "
                         f"outside the vocabulary [0, {vocab_size})")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{path}: tensor {name!r} holds duplicate token ids")


# --------------------------------------------------------------------------- save / push


def save_heads(heads, folder, card: bool = True, *, thresholds: list[float] | None = None,
               repo_id: str | None = None, token: str | None = None,
               revision: str | None = None, private: bool = False) -> Path:
    """Write config.json, heads.safetensors, calibration.json (and README.md) to `folder`;
    with `repo_id`, upload the folder to the Hub too (push_heads).

    Args:
        heads: ExitHeads or TopDraftHeads.
        thresholds: top-layer heads only: per-step thresholds to store (default: the
            heads' calibration, else 0 = always draft).
    """
    from safetensors.torch import save

    kind = kind_of(heads)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    heads.config.validate()
    calibration = kind.calibration_of(heads, thresholds)
    if heads.calibration is None:
        heads.calibration = calibration  # as loading the folder would give
    stored = kind.weights_dtype(heads.config)
    state = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    # floats in the file's dtype whatever the model's, so a file does not depend on it
    state = {k: v.to(stored) if v.is_floating_point() else v for k, v in state.items()}
    # save() + write_bytes rather than save_file: ordinary (umask) file permissions
    (folder / WEIGHTS_FILE).write_bytes(save(state, metadata={
        "format": "pt", "kind": kind.name,
        "hf_selfspec_format_version": str(heads.config.format_version)}))
    (folder / CONFIG_FILE).write_text(json.dumps(heads.config.to_dict(), indent=2) + "\n")
    (folder / CALIBRATION_FILE).write_text(json.dumps(calibration.to_dict(), indent=2) + "\n")
    if card:
        (folder / CARD_FILE).write_text(render_card(heads), encoding="utf-8")
    if repo_id is not None:
        push_heads(folder, repo_id, token=token, private=private, revision=revision)
    return folder


def push_heads(folder, repo_id: str, token: str | None = None, private: bool = False, *,
               revision: str | None = None, commit_message: str | None = None):
    """Upload a saved heads folder of any kind to the Hub as a model repo (created if
    needed; `revision` a branch, created if needed). The folder is loaded first with the
    kind-aware loader, so a malformed folder is refused before anything is uploaded; a
    folder without README.md gets the card rendered from its config. Only the heads files
    are uploaded. Returns huggingface_hub's CommitInfo."""
    from huggingface_hub import HfApi, ModelCard

    from .card import LIBRARY_NAME

    folder = Path(folder)
    for name in REQUIRED_FILES:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing: save_heads() the heads first")
    heads = load_heads(folder)  # every file validated
    card_path = folder / CARD_FILE
    if not card_path.is_file():
        card_path.write_text(render_card(heads), encoding="utf-8")
    library = ModelCard.load(card_path).data.library_name
    if library != LIBRARY_NAME:
        raise ValueError(f"{card_path}: field 'library_name' must be {LIBRARY_NAME!r} (the Hub "
                         f"shows how to load the heads from it), got {library!r}")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id=repo_id, branch=revision, repo_type="model", exist_ok=True)
        return api.upload_folder(
            folder_path=str(folder), repo_id=repo_id, repo_type="model", revision=revision,
            commit_message=commit_message or f"Upload hf_selfspec {heads.kind} heads",
            allow_patterns=list(HUB_FILES))
    except Exception as error:
        # a failed connection surfaces as the HTTP client's own exception (httpx2 from
        # huggingface_hub 2.x, httpx, requests),
        # which names neither the repo nor what was being done; the Hub's own errors (401,
        # 404, offline mode, ...) already say what went wrong and pass through
        origin = type(error).__module__.split(".")[0]
        if origin == "huggingface_hub" or not (
                origin in ("httpx2", "httpx", "requests", "urllib3")
                or isinstance(error, (ConnectionError, TimeoutError))):
            raise
        raise OSError(f"could not push heads from {folder} to the Hub repo {repo_id!r}: "
                      f"{type(error).__name__}: {error}. Check the network and the token (token= or "
                      "HF_TOKEN); the heads stay usable from the folder meanwhile") from error
