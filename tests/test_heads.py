"""Exit heads: module semantics, repo format (save/load/validate/push), training, calibration.

Tiny random-weight Llama models (vocab 260, hidden 64, 4 layers) built here; the real
default model only where cheap (loading the shipped heads).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_selfspec.data import Conversation
from hf_selfspec.heads import (
    Calibration,
    ExitHead,
    ExitHeads,
    HeadsConfig,
    default_heads_path,
    fingerprint,
    isotonic_fit,
    load_heads,
    push_heads,
    save_heads,
)
from hf_selfspec.heads.calibrate import NEVER
from hf_selfspec.heads.train import (
    TrainConfig,
    choose_vocab,
    collect_features,
    evaluate_head,
    train_head,
)

torch.set_num_threads(1)
VOCAB = 260
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_model(seed: int = 0, hidden: int = 64, layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens + 2 specials) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"})
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def trained_like_heads(model, seed: int = 0) -> ExitHeads:
    """Heads at layers 1 and 2 with random (non-initial) weights and a calibration."""
    g = torch.Generator().manual_seed(seed)
    vocab = [torch.arange(0, VOCAB, 2)[:100], torch.arange(VOCAB)[-120:]]
    heads = ExitHeads.create(model, [1, 2], vocab, adapter_dims=[16, 8])
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    conf = [torch.rand(500, generator=g) for _ in heads]
    acc = [torch.rand(500, generator=g) < c for c in conf]
    heads.calibration = Calibration.fit(conf, acc)
    return heads


# --------------------------------------------------------------------------- module


def test_head_outputs_shapes_and_semantics(model):
    heads = trained_like_heads(model)
    head = heads[0]
    x = torch.randn(5, 64)
    logits = head(x)
    assert logits.shape == (5, 101)  # V_k + reject
    conf, tokens = head.propose(x)
    assert conf.dtype == torch.float32 and tokens.dtype == torch.int64 and conf.shape == (5,)
    assert torch.isin(tokens, head.vocab_ids).all()
    probs, topk = head.topk(x, 4)
    assert probs.shape == topk.shape == (5, 4)
    assert torch.equal(topk[:, 0], tokens)
    assert torch.allclose(probs[:, 0], conf)  # reject does not win here
    assert (probs[:, :-1] >= probs[:, 1:]).all()
    q, ids = head.distribution(x, temperature=0.7)
    assert q.shape == (5, 100) and torch.allclose(q.sum(-1), torch.ones(5))
    assert torch.equal(ids, head.vocab_ids)
    with torch.no_grad():
        head.reject.bias.fill_(1e4)  # ⊥ wins everywhere -> confidence 0
    conf, tokens = head.propose(x)
    assert (conf == 0).all() and torch.isin(tokens, head.vocab_ids).all()
    with pytest.raises(ValueError, match="temperature"):
        head.distribution(x, temperature=0.0)


def test_fresh_head_is_the_logit_lens(model):
    """up = 0 and w_out = final norm: a fresh head scores final_norm(h) @ E[V_k]."""
    heads = ExitHeads.create(model, [2], torch.arange(VOCAB), reject_class=False)
    h = torch.randn(3, 64)
    expected = model.lm_head(model.model.norm(h))
    assert torch.allclose(heads[0](h), expected, atol=1e-5)


def test_head_needs_bind():
    head = ExitHead(1, 64, torch.arange(10))
    with pytest.raises(RuntimeError, match="bind"):
        head.propose(torch.randn(1, 64))


def test_propose_cost_report(model):
    """Not a timed assert: prints ms per propose on one row (tiny model)."""
    head = trained_like_heads(model)[0]
    x = torch.randn(1, 64)
    for _ in range(10):
        head.propose(x)
    t0 = time.perf_counter()
    for _ in range(100):
        head.propose(x)
    print(f"propose: {(time.perf_counter() - t0) * 10:.3f} ms per row")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layers": [2, 1]}, "strictly increasing"),
        ({"layers": [1, 4]}, r"in \[1, 3\]"),
        ({"vocab_sizes": [10]}, "vocab_sizes has 1"),
        ({"vocab_sizes": [10, 999]}, "vocab_sizes"),
        ({"format_version": 99}, "format_version 99"),
        ({"kind": "medusa"}, "kind 'medusa'"),
        ({"num_layers": 0}, "num_layers"),
    ],
)
def test_config_validation(model, change, message):
    data = trained_like_heads(model).config.to_dict()
    data.update(change)
    with pytest.raises(ValueError, match=message):
        HeadsConfig.from_dict(data)


def test_config_missing_field(model):
    data = trained_like_heads(model).config.to_dict()
    del data["layers"]
    with pytest.raises(ValueError, match="misses layers"):
        HeadsConfig.from_dict(data)


# --------------------------------------------------------------------------- repo


def test_save_load_round_trip_bit_equal(model, tmp_path):
    heads = trained_like_heads(model)
    save_heads(heads, tmp_path / "h")
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == [
        "README.md",
        "calibration.json",
        "config.json",
        "heads.safetensors",
    ]
    loaded = load_heads(tmp_path / "h", model)
    assert loaded.layers == [1, 2] and loaded.config.to_dict() == heads.config.to_dict()
    x = torch.randn(7, 64)
    for a, b in zip(heads, loaded):
        assert torch.equal(a(x), b(x))
        assert all(torch.equal(u, v) for u, v in zip(a.propose(x), b.propose(x)))
    assert loaded.calibration.thresholds == heads.calibration.thresholds
    # The LM-head rows are not in the file: it holds adapters, norms, reject, vocab ids.
    from safetensors import safe_open

    with safe_open(str(tmp_path / "h" / "heads.safetensors"), "pt") as f:
        assert not any("lm_rows" in k for k in f.keys())  # noqa: SIM118 (safe_open has no __iter__)


def test_card_metadata(model, tmp_path):
    heads = trained_like_heads(model)
    heads.config.training = {
        "heads": [{"eval_top1": 0.25}, {"eval_top1": 0.3}],
        "datasets": ["some/data"],
        "train_positions": 123,
    }
    save_heads(heads, tmp_path)
    card = (tmp_path / "README.md").read_text()
    import yaml

    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "hf_selfspec"
    assert meta["base_model"] == heads.config.base_model
    assert meta["base_model_relation"] == "adapter" and "exit-heads" in meta["tags"]
    assert meta["hf_selfspec"]["top1_agreement"] == [0.25, 0.3]
    assert meta["datasets"] == ["some/data"] and "license" in meta
    assert "| 1 | 100 | 16 | 0.250 |" in card


def test_card_template_mirror():
    root = Path(__file__).resolve().parent.parent
    for name in ("heads_card.md.j2", "top_heads_card.md.j2"):  # one template per head kind
        mirror = root / "model_cards" / name
        packaged = root / "hf_selfspec" / "model_cards" / name
        assert mirror.read_text() == packaged.read_text()


def test_wrong_base_model_is_an_error(model, tmp_path):
    save_heads(trained_like_heads(model), tmp_path)
    with pytest.raises(ValueError, match="heads are for .*other weights"):
        load_heads(tmp_path, tiny_model(seed=1))
    with pytest.raises(ValueError, match="hidden_size=64"):
        load_heads(tmp_path, tiny_model(hidden=32))
    with pytest.raises(ValueError, match="num_layers=4"):
        load_heads(tmp_path, tiny_model(layers=6))


def test_same_model_in_other_dtype_loads(model, tmp_path):
    """The same checkpoint in bf16 / fp16 loads without a mismatch warning: its weights
    equal the stored probe up to the rounding of its dtype."""
    import warnings

    from hf_selfspec.heads import HeadsMismatchWarning

    save_heads(trained_like_heads(model), tmp_path)
    for dtype in (torch.bfloat16, torch.float16):
        other = tiny_model().to(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error", HeadsMismatchWarning)
            heads = load_heads(tmp_path, other)
        conf, _ = heads[0].propose(torch.randn(2, 64, dtype=dtype))
        assert conf.shape == (2,)
    assert fingerprint(tiny_model().to(torch.bfloat16)) == fingerprint(model)


def test_fingerprint(model):
    assert fingerprint(model) == fingerprint(tiny_model())
    assert fingerprint(model) != fingerprint(tiny_model(seed=1))
    t0 = time.perf_counter()
    fingerprint(model)
    assert time.perf_counter() - t0 < 0.5  # generous: the real figure is ~1 ms


def test_missing_files(model, tmp_path):
    save_heads(trained_like_heads(model), tmp_path)
    for name in ("heads.safetensors", "calibration.json", "config.json"):
        broken = tmp_path / f"no_{name}"
        shutil.copytree(tmp_path, broken, ignore=shutil.ignore_patterns("no_*"))
        (broken / name).unlink()
        with pytest.raises(FileNotFoundError, match=name.replace(".", r"\.")):
            load_heads(broken, model)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_heads(tmp_path / "nowhere", model)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "header"])
def test_corrupt_safetensors(model, tmp_path, damage):
    save_heads(trained_like_heads(model), tmp_path)
    path = tmp_path / "heads.safetensors"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\x01not a safetensors file" * 10)
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a header length pointing past the end
        path.write_bytes((10**9).to_bytes(8, "little") + data[8:])
    with pytest.raises(ValueError, match=r"heads\.safetensors is corrupt or truncated"):
        load_heads(tmp_path, model)


def test_bad_json_and_mismatched_weights(model, tmp_path):
    save_heads(trained_like_heads(model), tmp_path)
    (tmp_path / "calibration.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"calibration\.json is not valid JSON"):
        load_heads(tmp_path, model)
    save_heads(trained_like_heads(model), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["adapter_dims"] = [32, 8]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"heads\.safetensors does not match"):
        load_heads(tmp_path, model)
    config["format_version"] = 7
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: heads format_version 7"):
        load_heads(tmp_path, model)


def _hub_cache(tmp_path, folder, repo_id="org/tiny-heads") -> Path:
    """Lay out `folder` as a Hub cache snapshot of `repo_id` (refs/main -> commit)."""
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return cache


def test_load_from_hub_cache_offline(model, tmp_path, monkeypatch):
    heads = trained_like_heads(model)
    save_heads(heads, tmp_path / "h")
    cache = _hub_cache(tmp_path, tmp_path / "h")
    x = torch.randn(3, 64)
    loaded = load_heads("org/tiny-heads", model, cache_dir=cache, local_files_only=True)
    assert torch.equal(loaded[1](x), heads[1](x))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    loaded = load_heads("org/tiny-heads", model, cache_dir=cache)  # HF_HUB_OFFLINE honoured
    assert torch.equal(loaded[0](x), heads[0](x))
    with pytest.raises(OSError, match="could not get heads 'org/missing'"):
        load_heads("org/missing", model, cache_dir=cache)


def test_push_calls_upload_folder(model, tmp_path):
    save_heads(trained_like_heads(model), tmp_path)
    with mock.patch("huggingface_hub.HfApi") as api_class:
        push_heads(tmp_path, "me/my-heads", token="hf_xyz", private=True)
    api_class.assert_called_once_with(token="hf_xyz")
    api = api_class.return_value
    api.create_repo.assert_called_once_with(
        repo_id="me/my-heads", repo_type="model", private=True, exist_ok=True
    )
    api.upload_folder.assert_called_once()
    kwargs = api.upload_folder.call_args.kwargs
    assert kwargs["folder_path"] == str(tmp_path) and kwargs["repo_id"] == "me/my-heads"
    assert kwargs["repo_type"] == "model"
    # no network: the HTTP client's connection error names the repo and what failed (the
    # client huggingface_hub uses, httpx2 in 2.x, and any other installed)
    import importlib
    import importlib.util

    clients = [name for name in ("httpx2", "httpx") if importlib.util.find_spec(name)]
    assert clients, "huggingface_hub's HTTP client (httpx2 or httpx) is not installed"
    for name in clients:
        error = importlib.import_module(name).ConnectError("Name or service not known")
        with mock.patch("huggingface_hub.HfApi") as api_class:
            api_class.return_value.create_repo.side_effect = error
            with pytest.raises(OSError, match="could not push heads from .* to the Hub repo 'me/my-heads'"):
                push_heads(tmp_path, "me/my-heads")
    (tmp_path / "heads.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="heads.safetensors"):
        push_heads(tmp_path, "me/my-heads")


# --------------------------------------------------------------------------- calibration


def test_isotonic_fit_pav():
    x, y, w = isotonic_fit([1, 2, 3, 4], [1, 3, 2, 4])
    assert np.allclose(y, [1, 2.5, 4]) and np.allclose(x, [1, 2.5, 4]) and np.allclose(w, [1, 2, 1])
    x, y, _ = isotonic_fit([0, 0, 1], [1, 0, 1])  # ties pooled first
    assert np.allclose(x, [0, 1]) and np.allclose(y, [0.5, 1])


def test_calibration_monotone_and_thresholds():
    rng = np.random.default_rng(0)
    conf = rng.random(5000)
    acc = rng.random(5000) < conf**2  # true P(accept) = conf^2, noisy
    cal = Calibration.fit([conf, np.zeros(100)], [acc, np.zeros(100, bool)], min_accept=0.5)
    grid = torch.linspace(0, 1, 1001)
    p = cal.accept_prob(0, grid)
    assert (p[1:] >= p[:-1]).all() and p.min() >= 0 and p.max() <= 1
    assert abs(cal.thresholds[0] - 0.5**0.5) < 0.05
    assert cal.thresholds[1] == NEVER  # a head that is never right never drafts
    assert abs(float(cal.accept_prob(0, torch.tensor(cal.thresholds[0]))) - 0.5) < 1e-3
    cost = Calibration.fit([conf], [acc], cost_of_draft=0.25)
    assert cost.thresholds[0] < cal.thresholds[0]
    assert abs(cal.threshold_for(0, 0.25) - cost.thresholds[0]) < 1e-5
    per_head = Calibration.fit([conf, conf], [acc, acc], min_accept=[0.25, 0.64])
    assert per_head.thresholds[0] < per_head.thresholds[1]
    assert abs(per_head.thresholds[1] - 0.8) < 0.05 and per_head.heads[1].min_accept == 0.64
    again = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert again.thresholds == cal.thresholds
    assert torch.allclose(again.accept_prob(0, grid), p)
    bad = cal.to_dict()
    bad["heads"][0]["knots_y"] = bad["heads"][0]["knots_y"][::-1]
    with pytest.raises(ValueError, match="non-decreasing"):
        Calibration.from_dict(bad)


# --------------------------------------------------------------------------- training


def test_collect_features_resumable(tmp_path):
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    model = tiny_model()
    conversations = [
        Conversation(
            f"c{i}",
            [
                {"role": "user", "content": f"question {i}?"},
                {"role": "assistant", "content": f"answer number {i} ok"},
            ],
        )
        for i in range(6)
    ]
    store = collect_features(
        model,
        tokenizer,
        conversations[:3],
        [1, 3],
        tmp_path / "f",
        chunk_positions=10,
        progress=False,
    )
    first = len(store)
    store = collect_features(
        model, tokenizer, conversations, [1, 3], tmp_path / "f", chunk_positions=10, progress=False
    )  # resumes after conversation 3
    assert store.state["conversations_done"] == 6
    hidden, targets, conv = store.load(3)
    assert hidden.shape == (len(store), 64) and hidden.dtype == torch.float16
    assert len(store) > first and sorted(set(conv.tolist())) == list(range(6))
    # Targets are the model's argmax at positions whose next token is the assistant's.
    from hf_selfspec.data import render_chat

    r = render_chat(tokenizer, conversations[0].messages)
    ids = torch.tensor([r.input_ids])
    out = model(ids, output_hidden_states=True)
    pos = torch.tensor(r.assistant_mask[1:]).nonzero().squeeze(1)
    assert torch.equal(targets[conv == 0], out.logits[0, pos].argmax(-1))
    assert torch.allclose(hidden[conv == 0].float(), out.hidden_states[3][0, pos], atol=1e-2)
    with pytest.raises(ValueError, match="other settings"):
        collect_features(model, tokenizer, conversations, [2], tmp_path / "f", progress=False)


def _synthetic_features(model, n_seq: int, seed: int):
    """Hidden states at layer 2 and greedy targets of random token sequences."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n_seq, 64), generator=g)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return out.hidden_states[2].reshape(-1, 64), out.logits.argmax(-1).reshape(-1)


def test_training_lowers_loss_and_beats_chance(tmp_path):
    # Untied embeddings: with tied ones a random model mostly predicts its input token,
    # which the fresh (logit-lens) head already gets right.
    model = tiny_model()
    model.config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(model.config).eval()
    train_h, train_t = _synthetic_features(model, 160, seed=0)
    val_h, val_t = _synthetic_features(model, 20, seed=1)
    vocab_ids, mass = choose_vocab(train_t, 128, VOCAB)
    assert 0 < mass <= 1 and vocab_ids.numel() <= 128
    head = ExitHeads.create(model, [2], vocab_ids, adapter_dims=32)[0]
    before = evaluate_head(head, train_h[:3000], train_t[:3000])["top1"]
    cfg = TrainConfig(epochs=3, batch_size=256, lr=1e-3, warmup_steps=5, seed=0)
    history = train_head(
        head,
        train_h,
        train_t,
        val_h,
        val_t,
        cfg,
        vocab_size=VOCAB,
        checkpoint=tmp_path / "ckpt.pt",
        progress=False,
    )
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert evaluate_head(head, train_h[:3000], train_t[:3000])["top1"] > before + 0.02
    chance = float(torch.bincount(val_t).max()) / val_t.numel()  # always the most common token
    assert evaluate_head(head, val_h, val_t)["top1"] > chance + 0.05
    # Resuming a finished run from its checkpoint gives the same head.
    again = ExitHeads.create(model, [2], vocab_ids, adapter_dims=32)[0]
    train_head(
        again,
        train_h,
        train_t,
        val_h,
        val_t,
        cfg,
        vocab_size=VOCAB,
        checkpoint=tmp_path / "ckpt.pt",
        progress=False,
    )
    assert all(
        torch.equal(a, b) for a, b in zip(again.state_dict().values(), head.state_dict().values())
    )


# --------------------------------------------------------------------------- shipped heads


@pytest.mark.slow
def test_shipped_exit_heads_load_and_propose():
    from hf_selfspec.heads import exit_heads_path

    folder = exit_heads_path()
    shipped = [p for d in (folder, default_heads_path()) for p in d.iterdir()]
    assert sum(p.stat().st_size for p in shipped) <= 12 * 2**20  # all shipped heads together
    from hf_selfspec.defaults import load_default_model_and_tokenizer

    model, _ = load_default_model_and_tokenizer()
    heads = load_heads(folder, model)
    assert heads.layers == sorted(heads.layers) and len(heads.calibration.thresholds) == len(heads)
    conf, tokens = heads[0].propose(torch.randn(2, model.config.hidden_size))
    assert conf.shape == tokens.shape == (2,)
    with pytest.raises(ValueError, match="heads are for"):
        load_heads(folder, tiny_model())


def test_heads_package_has_no_import_cycle():
    """Every module of hf_selfspec/heads imports the others only one way (base first):
    the graph of package-relative imports is acyclic."""
    import ast

    folder = Path(__file__).resolve().parent.parent / "hf_selfspec" / "heads"
    graph = {}
    for path in folder.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
                deps.update(n.split(".")[0] for n in names)
        graph[path.stem] = deps & {p.stem for p in folder.glob("*.py")}
    graph.pop("__init__")
    done: set[str] = set()

    def visit(name, stack):
        assert name not in stack, f"import cycle: {' -> '.join([*stack, name])}"
        if name not in done:
            for dep in graph.get(name, ()):
                visit(dep, [*stack, name])
            done.add(name)

    for name in graph:
        visit(name, [])
    assert graph["base"] <= {"checks"} and "repo" not in graph["kinds"] | graph["top"] | graph["exit"]


# --------------------------------------------------------------------------- the kind table


def _subclasses(cls) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | _subclasses(sub)
    return found


def test_kind_table_covers_every_kind(model, tmp_path):
    """Every heads config class (a HeadsIdentity) and every heads class of the package has
    its entry in the kind table, under its own kind string; each entry's heads save, load
    back as that kind and get their drafter from the one factory (make_drafter)."""
    from conftest import engine_or_skip
    from test_decoding import random_heads

    import hf_selfspec.heads as heads_package
    from hf_selfspec.decoding.cycle import DecodeConfig, SelfSpecDecoder
    from hf_selfspec.decoding.drafters import ExitHeadsDrafter, TopHeadsDrafter
    from hf_selfspec.engine.core import EngineConfig
    from hf_selfspec.heads import KINDS, HeadsIdentity, is_heads, kind_of, make_drafter
    from hf_selfspec.heads.top import random_top_heads

    configs = {c for c in _subclasses(HeadsIdentity) if c.__module__.startswith("hf_selfspec.")}
    assert configs == {kind.config for kind in KINDS.values()}
    modules = {v for v in vars(heads_package).values()
               if isinstance(v, type) and issubclass(v, torch.nn.Module) and isinstance(getattr(v, "kind", None), str)}
    assert modules == {kind.module for kind in KINDS.values()}
    for name, kind in KINDS.items():
        assert kind.name == name == kind.config.KIND == kind.module.kind
    engine = engine_or_skip(model, EngineConfig(width=4, capacity=64, row_layout="fixed"))
    drafters = {"exit_head": ExitHeadsDrafter, "top_draft": TopHeadsDrafter}
    assert drafters.keys() == KINDS.keys()
    made = {"exit_head": random_heads(model, [1, 2]), "top_draft": random_top_heads(model, depth=2)}
    for name, heads in made.items():
        assert is_heads(heads) and kind_of(heads) is KINDS[name]
        save_heads(heads, tmp_path / name)
        loaded = load_heads(tmp_path / name, model, kind=name)
        assert type(loaded) is KINDS[name].module
        assert type(loaded.config).from_dict(loaded.config.to_dict()) == loaded.config
        config = DecodeConfig(thresholds=0.5)
        assert type(make_drafter(engine, loaded, [0.5, 0.5], config)) is drafters[name]
        decoder = SelfSpecDecoder(engine, loaded, config)
        assert type(decoder.drafter) is drafters[name] and decoder.num_sources == 2
    other = "top_draft" if name == "exit_head" else "exit_head"
    with pytest.raises(ValueError, match=f"field 'kind' is {name!r}, not {other!r}"):
        load_heads(tmp_path / name, kind=other)


def test_unknown_kind_is_a_clear_error(model, tmp_path):
    """config.json naming a kind the table lacks: one ValueError naming the file, the field,
    the kind found and the kinds there are; heads objects of no known kind likewise."""
    from types import SimpleNamespace

    from hf_selfspec.heads import KINDS, kind_of, read_kind

    save_heads(trained_like_heads(model), tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["kind"] = "medusa"
    path.write_text(json.dumps(config))
    assert read_kind(tmp_path) == "medusa"
    with pytest.raises(ValueError) as error:
        load_heads(tmp_path, model)
    message = str(error.value)
    assert str(path) in message and "field 'kind'" in message and "'medusa'" in message
    assert all(repr(name) in message for name in KINDS)
    for bad in (SimpleNamespace(kind="medusa"), SimpleNamespace(), SimpleNamespace(kind=3)):
        with pytest.raises(ValueError, match="not heads of a known kind"):
            kind_of(bad)
