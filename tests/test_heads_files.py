"""Heads files from strangers, near-identical checkpoints, and the Hub: what the one repo
module (hf_selfspec.heads.repo) accepts, warns about and refuses, for every head kind.

Each bad-file case copies a shipped heads folder, corrupts one thing, and checks the error
type and the words of its message (the file and the field). The shipped-heads cases use
the real default model (session fixture); the rest tiny random models.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import warnings
from typing import ClassVar

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from safetensors.torch import load_file, save_file
from test_decoding import random_heads

from hf_selfspec import attach_heads, detach_heads
from hf_selfspec.heads import (
    HeadsMismatchWarning,
    default_heads_path,
    exit_heads_path,
    load_heads,
    push_heads,
    save_heads,
    weight_probe,
)
from hf_selfspec.heads.top import random_top_heads

# --------------------------------------------------------------------------- helpers


def _copy(src, tmp_path, name="heads"):
    return shutil.copytree(src, tmp_path / name)


def _edit_json(path, change):
    data = json.loads(path.read_text())
    data = change(data)
    path.write_text(json.dumps(data))


def _set(**fields):
    def change(data):
        data.update(fields)
        return data
    return change


def _edit_weights(folder, change):
    path = folder / "heads.safetensors"
    state = load_file(str(path))
    change(state)
    save_file(state, str(path))


# --------------------------------------------------------------------------- stranger's files

# (file, change, words the message must hold); every case on the shipped default heads
CONFIG = "config.json"
CALIB = "calibration.json"
TOP_CASES = {
    "config_is_a_list": (CONFIG, lambda d: [d], ["config.json", "JSON object", "list"]),
    "calibration_is_a_list": (CALIB, lambda d: [d], ["calibration.json", "JSON object", "list"]),
    "fingerprint_not_a_string": (CONFIG, _set(base_fingerprint=12345), ["config.json", "base_fingerprint"]),
    "huge_adapter": (CONFIG, _set(adapter_dim=10**9), ["config.json", "adapter_dim"]),
    "huge_depth": (CONFIG, _set(depth=10**6), ["config.json", "depth"]),
    "reduced_vocab_above_vocab": (CONFIG, _set(reduced_vocab=10**6), ["config.json", "reduced_vocab"]),
    "vocab_size_not_the_model's": (CONFIG, _set(vocab_size=10**6, reduced_vocab=8192),
                                   ["config.json", "vocab_size"]),
    "hidden_size_not_the_model's": (CONFIG, _set(hidden_size=577), ["config.json", "hidden_size"]),
    "num_layers_not_the_model's": (CONFIG, _set(num_layers=31), ["config.json", "num_layers"]),
    "depth_a_string": (CONFIG, _set(depth="3"), ["config.json", "depth"]),
    "depth_a_bool": (CONFIG, _set(depth=True), ["config.json", "depth"]),
    "eps_nan": (CONFIG, _set(rms_norm_eps=math.nan), ["config.json", "rms_norm_eps"]),
    "unknown_kind": (CONFIG, _set(kind="medusa"), ["config.json", "kind"]),
    "storage_dtype_unknown": (CONFIG, _set(storage_dtype="int8"), ["config.json", "storage_dtype"]),
    "probe_not_numbers": (CONFIG, _set(base_probe=["a"]), ["config.json", "base_probe"]),
    "training_a_list": (CONFIG, _set(training=[1]), ["config.json", "training"]),
    "missing_field": (CONFIG, lambda d: {k: v for k, v in d.items() if k != "depth"},
                      ["config.json", "misses depth"]),
    "threshold_nan": (CALIB, _set(thresholds=[math.nan, 0.0, 0.0]), ["calibration.json", "thresholds[0]"]),
    "threshold_a_string": (CALIB, _set(thresholds=["0.1", 0.0, 0.0]), ["calibration.json", "thresholds[0]"]),
    "threshold_count": (CALIB, _set(thresholds=[0.0]), ["calibration.json", "thresholds", "1 entries"]),
    "thresholds_not_a_list": (CALIB, _set(thresholds=0.5), ["calibration.json", "thresholds"]),
}


@pytest.fixture(scope="module")
def model(default_model):
    return default_model[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(TOP_CASES))
def test_bad_json_is_refused_before_allocation(model, tmp_path, case):
    name, change, words = TOP_CASES[case]
    folder = _copy(default_heads_path(), tmp_path)
    _edit_json(folder / name, change)
    with pytest.raises(ValueError) as error:
        load_heads(folder, model)
    for word in words:
        assert word in str(error.value), (word, str(error.value))


def _vocab(state, ids):
    state["vocab_ids"] = ids


WEIGHT_CASES = {
    "negative_vocab_id": (lambda s: s["vocab_ids"].__setitem__(0, -3), ["vocab_ids", "-3", "outside"]),
    "vocab_id_past_the_vocabulary": (lambda s: s["vocab_ids"].__setitem__(5, 49152),
                                     ["vocab_ids", "49152", "outside"]),
    "duplicate_vocab_ids": (lambda s: s["vocab_ids"].__setitem__(1, int(s["vocab_ids"][0])),
                            ["vocab_ids", "duplicate"]),
    "vocab_ids_2d": (lambda s: _vocab(s, s["vocab_ids"].reshape(2, -1).contiguous()),
                     ["vocab_ids", "shape", "[2, 4096]"]),
    "vocab_ids_float": (lambda s: _vocab(s, s["vocab_ids"].double()), ["vocab_ids", "dtype", "F64"]),
    "weight_shape": (lambda s: s.__setitem__("steps.0.up.weight", s["steps.0.up.weight"][:, :256].contiguous()),
                     ["steps.0.up.weight", "shape", "[576, 256]"]),
    "weight_dtype_not_the_storage_dtype": (lambda s: s.__setitem__("out_norm", s["out_norm"].float()),
                                           ["out_norm", "dtype", "F32", "F16"]),
    "missing_tensor": (lambda s: s.pop("steps.2.e_norm"), ["missing tensors", "steps.2.e_norm"]),
    "extra_tensor": (lambda s: s.__setitem__("payload", torch.zeros(3)), ["unexpected tensors", "payload"]),
    "nan_weight": (lambda s: s["out_norm"].__setitem__(0, math.nan), ["out_norm", "NaN"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(WEIGHT_CASES))
def test_bad_weights_are_refused(model, tmp_path, case):
    change, words = WEIGHT_CASES[case]
    folder = _copy(default_heads_path(), tmp_path)
    _edit_weights(folder, change)
    with pytest.raises(ValueError) as error:
        load_heads(folder, model)
    message = str(error.value)
    assert "heads.safetensors" in message
    for word in words:
        assert word in message, (word, message)


EXIT_CASES = {
    "layer_out_of_range": (CONFIG, _set(layers=[2, 10, 40]), ["config.json", "layers"]),
    "layers_not_a_list": (CONFIG, _set(layers=7), ["config.json", "layers"]),
    "huge_adapter": (CONFIG, _set(adapter_dims=[10**9, 256, 256]), ["config.json", "adapter_dims"]),
    "reject_class_a_string": (CONFIG, _set(reject_class="yes"), ["config.json", "reject_class"]),
    "calibration_knot_nan": (CALIB, lambda d: (d["heads"][0].__setitem__("knots_y", [math.nan] * len(
        d["heads"][0]["knots_y"])), d)[1], ["calibration.json", "head 0", "finite"]),
    "threshold_nan": (CALIB, lambda d: (d["heads"][1].__setitem__("threshold", math.nan), d)[1],
                      ["calibration.json", "head 1", "threshold"]),
    "calibration_head_count": (CALIB, lambda d: {**d, "heads": d["heads"][:1]},
                               ["calibration.json", "heads", "1 entries"]),
    "calibration_head_a_list": (CALIB, lambda d: {**d, "heads": [[1, 2]] * len(d["heads"])},
                                ["calibration.json", "head 0", "JSON object"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(EXIT_CASES))
def test_bad_exit_head_files_are_refused(model, tmp_path, case):
    name, change, words = EXIT_CASES[case]
    folder = _copy(exit_heads_path(), tmp_path)
    _edit_json(folder / name, change)
    with pytest.raises(ValueError) as error:
        load_heads(folder, model)
    for word in words:
        assert word in str(error.value), (word, str(error.value))


@pytest.mark.slow
def test_negative_exit_head_vocab_id(model, tmp_path):
    folder = _copy(exit_heads_path(), tmp_path)
    _edit_weights(folder, lambda s: s["heads.1.vocab_ids"].__setitem__(3, -1))
    with pytest.raises(ValueError, match=r"heads\.safetensors: tensor 'heads\.1\.vocab_ids' holds token id -1"):
        load_heads(folder, model)


def test_inspection_without_a_model_validates_too(tmp_path):
    """model=None (inspection, push-heads): the same checks, bounded by the config itself."""
    model = tiny_model("llama", seed=0, layers=4)
    save_heads(random_top_heads(model), tmp_path)
    _edit_json(tmp_path / CONFIG, _set(adapter_dim=10**8))
    with pytest.raises(ValueError, match=r"config\.json: field 'adapter_dim' must be an integer in \[1, 1024\]"):
        load_heads(tmp_path)


@pytest.mark.parametrize("name", [CONFIG, "calibration.json"])
def test_deeply_nested_json_is_a_clear_error(tmp_path, name):
    """json's decoder recurses once per nesting level: a hostile "[[[[...]]]]" file raised
    RecursionError from deep inside json, not the loaders' ValueError naming the file; a
    broken calibration.json also named its path twice."""
    model = tiny_model("llama", seed=0, layers=4)
    save_heads(random_top_heads(model), tmp_path)
    (tmp_path / name).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / name} is not a heads file: its "
                                                   "JSON is nested too deeply")):
        load_heads(tmp_path, model)
    (tmp_path / name).write_text("{not json")
    with pytest.raises(ValueError) as error:
        load_heads(tmp_path)
    assert str(error.value).count(str(tmp_path / name)) == 1, str(error.value)


# --------------------------------------------------------------------------- near-identical checkpoints


def _distance(caught) -> float:
    """The relative weight distance a HeadsMismatchWarning names."""
    message = next(str(w.message) for w in caught if issubclass(w.category, HeadsMismatchWarning))
    return float(re.search(r"relative weight distance (\S+) ", message).group(1))


def _kinds():
    return {"top_draft": random_top_heads, "exit_head": lambda m: random_heads(m, [1, 3])}


@pytest.mark.parametrize("kind", ["top_draft", "exit_head"])
def test_near_identical_checkpoint_warns_with_distance_and_decodes_exactly(kind, tmp_path):
    model = tiny_model("llama", seed=0, layers=4)
    save_heads(_kinds()[kind](model), tmp_path)
    near = perturbed_copy(model, 1e-3, seed=5)
    with pytest.warns(HeadsMismatchWarning, match=r"relative weight distance (\S+) ") as caught:
        attach_heads(near, str(tmp_path))
    assert 2e-4 < _distance(caught) < 3e-3
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(1))
    kw = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 20, "do_sample": False,
          "pad_token_id": 0}
    assert torch.equal(near.generate(ids, assistant="self", **kw), near.generate(ids, **kw))
    # the very model: no warning; another model of the same shape: refused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_heads(tmp_path, model)
    with pytest.raises(ValueError, match=r"other weights .*relative weight distance 1\.\d+ > 0\.5"):
        load_heads(tmp_path, tiny_model("llama", seed=1, layers=4))
    with pytest.raises(ValueError, match="vocab_size=256"):
        load_heads(tmp_path, tiny_model("llama", seed=0, layers=4, vocab=300))


def test_heads_without_a_probe_warn_that_the_distance_is_unknown(tmp_path):
    """Heads saved before the probe existed: a fingerprint that differs loads with a
    warning saying the distance cannot be measured."""
    model = tiny_model("llama", seed=0, layers=4)
    save_heads(random_top_heads(model), tmp_path)
    _edit_json(tmp_path / CONFIG, lambda d: {k: v for k, v in d.items() if k != "base_probe"})
    with pytest.warns(HeadsMismatchWarning, match="no weight probe"):
        load_heads(tmp_path, perturbed_copy(model, 1e-3))


def test_heads_without_a_probe_record_it_on_their_own_model(tmp_path):
    """Loaded on the model whose fingerprint they carry, older heads get its probe, and
    a re-save writes it: from then on a near-identical checkpoint gets a distance."""
    model = tiny_model("llama", seed=0, layers=4)
    save_heads(random_top_heads(model), tmp_path)
    _edit_json(tmp_path / CONFIG, lambda d: {k: v for k, v in d.items() if k != "base_probe"})
    heads = load_heads(tmp_path, model)
    assert heads.config.base_probe == weight_probe(model)
    save_heads(heads, tmp_path)
    with pytest.warns(HeadsMismatchWarning, match=r"relative weight distance (\S+) "):
        load_heads(tmp_path, perturbed_copy(model, 1e-3))


@pytest.mark.slow
def test_default_heads_on_a_perturbed_default_model(model):
    """The shipped heads carry the default model's weight probe, so on a copy of the default
    model with 1e-3 relative noise on every weight matrix (as on the official
    SmolLM2-135M-Instruct checkpoint, near the dequantised GGUF weights they were trained
    on) they load with a warning naming the relative weight distance, not "distance
    unknown", and decoding stays exactly the perturbed model's greedy output."""
    config = json.loads((default_heads_path() / CONFIG).read_text())
    assert config["base_probe"] == weight_probe(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_heads(default_heads_path(), model)  # their own model: silent
    near = detach_heads(perturbed_copy(model, 1e-3, seed=3))
    with pytest.warns(HeadsMismatchWarning, match=r"relative weight distance (\S+) ") as caught:
        load_heads(exit_heads_path(), near)  # the shipped exit heads carry a probe too
    assert 2e-4 < _distance(caught) < 3e-3
    with pytest.warns(HeadsMismatchWarning, match=r"relative weight distance (\S+) ") as caught:
        attach_heads(near)  # no heads= : the shipped default heads
    assert not any("no weight probe" in str(w.message) for w in caught)
    assert 2e-4 < _distance(caught) < 3e-3
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])  # a short English prompt
    kw = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 20, "do_sample": False}
    assert torch.equal(near.generate(ids, assistant="self", **kw), near.generate(ids, **kw))
    assert near.selfspec_stats.drafted > 0


# --------------------------------------------------------------------------- the Hub


class FakeHfApi:
    """huggingface_hub.HfApi stand-in: records calls; upload_folder 'uploads' the files its
    allow_patterns select into `uploaded`."""

    instances: ClassVar[list[FakeHfApi]] = []

    def __init__(self, token=None):
        self.token, self.calls, self.uploaded = token, [], {}
        FakeHfApi.instances.append(self)

    def create_repo(self, **kw):
        self.calls.append(("create_repo", kw))

    def create_branch(self, **kw):
        self.calls.append(("create_branch", kw))

    def upload_folder(self, *, folder_path, allow_patterns=None, **kw):
        from fnmatch import fnmatch
        from pathlib import Path

        self.calls.append(("upload_folder", kw))
        for p in Path(folder_path).iterdir():
            if allow_patterns is None or any(fnmatch(p.name, pat) for pat in allow_patterns):
                self.uploaded[p.name] = p.read_bytes()
        return type("CommitInfo", (), {"commit_url": f"https://hf.co/{kw['repo_id']}/commit/1"})()


@pytest.fixture
def fake_hub(monkeypatch):
    import huggingface_hub

    FakeHfApi.instances = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    return FakeHfApi.instances


@pytest.mark.parametrize("kind", ["top_draft", "exit_head"])
def test_push_heads_cli_uploads_every_kind(kind, tmp_path, fake_hub, capsys):
    from hf_selfspec.cli import main

    model = tiny_model("llama", seed=0, layers=4)
    folder = tmp_path / "heads"
    save_heads(_kinds()[kind](model), folder)
    (folder / "notes.txt").write_text("not a heads file")
    (folder / "README.md").unlink()  # rendered again at push time
    argv = ["push-heads", str(folder), "me/tiny-heads", "--token", "hf_x", "--private",
            "--revision", "v1"]
    assert main(argv) == 0
    api = fake_hub[0]
    assert api.token == "hf_x"
    assert [c[0] for c in api.calls] == ["create_repo", "create_branch", "upload_folder"]
    assert api.calls[0][1] == {"repo_id": "me/tiny-heads", "repo_type": "model", "private": True,
                               "exist_ok": True}
    assert api.calls[2][1]["revision"] == "v1" and kind in api.calls[2][1]["commit_message"]
    assert sorted(api.uploaded) == ["README.md", "calibration.json", "config.json", "heads.safetensors"]
    card = api.uploaded["README.md"].decode()
    import yaml

    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "hf_selfspec" and meta["base_model_relation"] == "adapter"
    assert meta["hf_selfspec"]["kind"] == kind
    assert "hf.co/me/tiny-heads" in capsys.readouterr().out
    # what was uploaded loads back as the same heads
    hub = tmp_path / "hub"
    hub.mkdir()
    for name, data in api.uploaded.items():
        (hub / name).write_bytes(data)
    assert load_heads(hub, model).kind == kind


def test_push_heads_refuses_a_bad_folder_before_uploading(tmp_path, fake_hub, capsys):
    from hf_selfspec.cli import main

    model = tiny_model("llama", seed=0, layers=4)
    save_heads(random_top_heads(model), tmp_path)
    _edit_json(tmp_path / CALIB, _set(thresholds=[math.nan, 0.0]))
    assert main(["push-heads", str(tmp_path), "me/tiny-heads"]) == 2
    assert "thresholds[0]" in capsys.readouterr().err
    assert fake_hub == []  # no Hub call at all
    save_heads(random_top_heads(model), tmp_path)
    (tmp_path / "README.md").write_text("---\nlibrary_name: transformers\n---\n# heads\n")
    with pytest.raises(ValueError, match=r"README\.md: field 'library_name' must be 'hf_selfspec'"):
        push_heads(tmp_path, "me/tiny-heads")


def test_hub_options_reach_snapshot_download(tmp_path, monkeypatch):
    import huggingface_hub

    model = tiny_model("llama", seed=0, layers=4)
    save_heads(random_top_heads(model), tmp_path / "snap")
    seen = {}

    def fake_snapshot_download(**kw):
        seen.update(kw)
        return str(tmp_path / "snap")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    heads = load_heads("org/heads", model, revision="v2", token="hf_t", cache_dir=tmp_path / "c",
                       local_files_only=True)
    assert heads.kind == "top_draft"
    assert seen["repo_id"] == "org/heads" and seen["revision"] == "v2" and seen["token"] == "hf_t"
    assert seen["cache_dir"] == tmp_path / "c" and seen["local_files_only"] is True
    assert sorted(seen["allow_patterns"]) == ["README.md", "calibration.json", "config.json",
                                              "heads.safetensors"]


def test_save_heads_with_repo_id_pushes(tmp_path, fake_hub):
    model = tiny_model("llama", seed=0, layers=4)
    save_heads(random_top_heads(model), tmp_path, repo_id="me/h", token="hf_y")
    assert fake_hub[0].token == "hf_y" and "heads.safetensors" in fake_hub[0].uploaded
