"""hf_selfspec.training end to end on a tiny random Llama: train-heads -> folder -> attach ->
generate(assistant="self") equals HF greedy token for token; resuming; bad input."""

from __future__ import annotations

import json

import pytest
import torch

from hf_selfspec.training.cli import main

PROMPTS = ["Say hello.", "Write a haiku about rain.", "What is 2 + 2?", "Name three colours.",
           "Explain gravity briefly.", "Translate 'cat' into French.", "List two prime numbers.",
           "Why is the sky blue?", "Give me a short story title.", "What day comes after Monday?",
           "Describe a tree.", "Count to five."]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer (its chat template), saved."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hf_selfspec.defaults import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    folder = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_prompts(path, prompts=PROMPTS):
    with path.open("w", encoding="utf-8") as f:
        for i, p in enumerate(prompts):  # both accepted line shapes
            record = {"prompt": p} if i % 2 else {"messages": [{"role": "user", "content": p}]}
            f.write(json.dumps(record) + "\n")
    return path


def args(model_folder, out, prompts, *extra):
    # the prompts run out long before a minute: collection ends early and the training
    # steps are capped, so the run is short whatever the machine's speed
    return [str(model_folder), "--out", str(out), "--minutes", "1", "--prompts", str(prompts),
            "--max-new-tokens", "16", "--batch-size", "4", "--max-steps", "6", "--threads", "1",
            "--no-progress", *extra]


def test_train_attach_and_decode_exactly(model_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    import hf_selfspec
    from hf_selfspec.heads import load_heads

    out = tmp_path / "heads"
    assert main(args(model_folder, out, write_prompts(tmp_path / "p.jsonl"), "--depth", "2")) == 0
    for name in ("config.json", "heads.safetensors", "calibration.json", "README.md"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    training = config["training"]
    assert config["kind"] == "top_draft" and config["depth"] == 2
    assert training["own_eval_positions"] > 0 and training["own_eval_tau_thr0.0"] >= 1.0
    assert training["collection"]["train_replies"] == 10 and training["collection"]["eval_replies"] == 2
    assert training["steps"] <= 6 and "train-heads" in training["reproduce"]
    card = (out / "README.md").read_text()
    assert "library_name: hf_selfspec" in card and "train-heads" in card
    # trained on the user's prompts: the card says so, and names no ShareGPT data
    assert "ShareGPT" not in card and "datasets" not in card.split("---")[1]
    assert "the user's own prompts (`p.jsonl`, --prompts)" in card
    assert "held-out prompts of the user's `p.jsonl`" in card

    model = AutoModelForCausalLM.from_pretrained(model_folder).eval()
    reference = AutoModelForCausalLM.from_pretrained(model_folder).eval()
    assert load_heads(out, model).config.depth == 2  # fingerprint and files check out
    hf_selfspec.attach_heads(model, heads=str(out))
    for seed in range(2):
        ids = torch.randint(3, 5000, (1, 20), generator=torch.Generator().manual_seed(seed))
        kw = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 32, "do_sample": False,
              "pad_token_id": 0}
        expected = reference.generate(ids, **kw)
        assert torch.equal(model.generate(ids, assistant="self", **kw), expected)


def test_a_second_run_continues_the_first(model_folder, tmp_path):
    """An interrupted collection (one batch of training replies) is continued by the next
    run on the same folder; a run with other collection settings is refused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_selfspec.training.data import (
        CollectSettings,
        PromptSource,
        WorkState,
        collect_split,
        work_key,
    )

    prompts = write_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "heads"
    work = out / "work"
    work.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(model_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    source, settings = PromptSource(prompts), CollectSettings(batch_size=4, max_new_tokens=16)
    state = WorkState.open(work, work_key(model, source, settings))
    # an interrupted run: one batch (max_positions stops it, as a spent budget would)
    collect_split(model, tokenizer, source, "train", work, state, settings, 60.0, max_positions=1,
                  progress=False)
    assert state.splits["train"].consumed == 4 and state.splits["train"].parts == 1

    assert main(args(model_folder, out, prompts)) == 0
    state = json.loads((work / "state.json").read_text())["splits"]
    assert state["train"]["consumed"] == 10 and state["train"]["parts"] == 3 and state["train"]["exhausted"]
    assert state["eval"]["replies"] == 2
    training = json.loads((out / "config.json").read_text())["training"]
    assert training["collection"]["train_replies"] == 10

    assert main(args(model_folder, out, prompts)[:-1] + ["--batch-size", "2", "--no-progress"]) == 2


def test_bad_input_is_one_clear_line(tmp_path, capsys, model_folder):
    missing = tmp_path / "nope.jsonl"
    assert main(["default", "--out", str(tmp_path / "o"), "--minutes", "1", "--prompts", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(missing) in err and len(err.splitlines()) == 1
    assert main(["default", "--out", str(tmp_path / "o"), "--minutes", "0"]) == 2
    assert "--minutes must be > 0" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    assert main([str(model_folder), "--out", str(tmp_path / "o"), "--minutes", "1", "--prompts", str(bad),
                 "--no-progress"]) == 2
    assert "line 2" in capsys.readouterr().err
    assert main([str(tmp_path / "no_model"), "--out", str(tmp_path / "o"), "--minutes", "1"]) == 2
    assert "cannot load model" in capsys.readouterr().err


def test_unsupported_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_selfspec.training.recipe import check_model

    with pytest.raises(ValueError, match="causal LM"):
        check_model(torch.nn.Linear(2, 2))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="final norm"):  # no Llama-family model.model.norm
        check_model(gpt2)


def test_card_names_the_prompts_the_heads_were_trained_on():
    """The card's training text and dataset follow config.training's `prompts`: ShareGPT
    (the default, or heads that record none, like the shipped ones) or the user's file."""
    from conftest import tiny_model
    from test_decoding import random_top_heads

    from hf_selfspec.heads.card import render_card

    heads = random_top_heads(tiny_model("llama", seed=0, layers=2))
    figures = {"data": "own", "train_positions": 100, "epochs": 1, "train_seconds": 1.0,
               "own_eval_step0_top1_given_reached": 0.5, "own_eval_tau_thr0.0": 1.4}
    cards = {}
    for prompts, datasets in (("sharegpt", ["anon8231489123/ShareGPT_Vicuna_unfiltered"]),
                              ("/home/me/private/chat.jsonl", [])):
        heads.config.training = {**figures, "prompts": prompts, "datasets": datasets}
        cards[prompts] = render_card(heads)
    shared = cards["sharegpt"]
    assert "replies to ShareGPT train prompts" in shared and "held-out ShareGPT prompts" in shared
    assert "- anon8231489123/ShareGPT_Vicuna_unfiltered" in shared
    own = cards["/home/me/private/chat.jsonl"]
    assert "ShareGPT" not in own and "datasets" not in own.split("---")[1]
    assert "replies to the user's own prompts (`chat.jsonl`, --prompts)" in own
