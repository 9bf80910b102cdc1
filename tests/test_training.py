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


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's products are too small to share: two threads on a busy 2-core
    machine make each forward ~20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    assert "--minutes must be a finite number > 0" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    assert main([str(model_folder), "--out", str(tmp_path / "o"), "--minutes", "1", "--prompts", str(bad),
                 "--no-progress"]) == 2
    assert "line 2" in capsys.readouterr().err
    assert main([str(tmp_path / "no_model"), "--out", str(tmp_path / "o"), "--minutes", "1"]) == 2
    assert f"MODEL {tmp_path / 'no_model'}: no such model folder" in capsys.readouterr().err
    (tmp_path / "empty_model").mkdir()
    assert main([str(tmp_path / "empty_model"), "--out", str(tmp_path / "o"), "--minutes", "1"]) == 2
    assert "cannot load model" in capsys.readouterr().err


def test_unsupported_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel, RwkvConfig, RwkvForCausalLM

    from hf_selfspec.training.recipe import check_model

    with pytest.raises(ValueError, match="causal LM"):
        check_model(torch.nn.Linear(2, 2))
    rwkv = RwkvForCausalLM(RwkvConfig(num_hidden_layers=2, hidden_size=32, vocab_size=64, attention_hidden_size=32,
                                      intermediate_size=64))  # RWKV: not served
    with pytest.raises(ValueError, match="model_type='rwkv'"):
        check_model(rwkv)
    check_model(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))  # served


def test_card_names_the_prompts_the_heads_were_trained_on():
    """The card's training text and dataset follow config.training's `prompts`: ShareGPT
    (the default, or heads that record none, like the shipped ones) or the user's file."""
    from conftest import tiny_model

    from hf_selfspec.heads import render_card
    from hf_selfspec.heads.top import random_top_heads

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


def heads_tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "heads.safetensors"))


def test_fine_tune_deepen_and_train_new_steps_only(model_folder, tmp_path):
    """Collect once (--work, --only collect), train heads of depth 2 on it, deepen them to 3
    training only the added step (the first two steps and the output norm stay bit for
    bit), then fine-tune every step; the card and config say what each started from."""
    prompts, work = write_prompts(tmp_path / "p.jsonl"), tmp_path / "replies"

    def run(out, *extra):
        return main(args(model_folder, tmp_path / out, prompts, "--work", str(work), *extra))

    assert run("d2", "--only", "collect") == 0
    assert not (tmp_path / "d2").exists()  # the replies went to --work, no heads yet
    assert run("d2", "--only", "train", "--depth", "2") == 0
    assert run("d3", "--only", "train", "--init", str(tmp_path / "d2"), "--depth", "3", "--new-steps-only",
               "--lr", "1e-2") == 0
    d2, d3 = heads_tensors(tmp_path / "d2"), heads_tensors(tmp_path / "d3")
    assert all(torch.equal(d3[k], v) for k, v in d2.items())  # steps 0-1, out norm, vocabulary
    step2 = [k for k in d3 if k.startswith("steps.2.")]
    assert step2 and any(not torch.equal(d3[k], d3[k.replace("steps.2.", "steps.1.")]) for k in step2)
    t2 = json.loads((tmp_path / "d2" / "config.json").read_text())["training"]
    config = json.loads((tmp_path / "d3" / "config.json").read_text())
    t3 = config["training"]
    assert config["depth"] == 3 and t3["new_steps_only"] and t3["init_training"] == t2
    card = (tmp_path / "d3" / "README.md").read_text()
    assert "the added steps alone (earlier steps frozen)" in card and "fine-tuned from heads trained on" in card

    assert run("d3b", "--only", "train", "--init", str(tmp_path / "d3")) == 0  # depth: the init's
    d3b = heads_tensors(tmp_path / "d3b")
    assert not torch.equal(d3b["steps.0.h_norm"], d3["steps.0.h_norm"])  # every step trained
    assert json.loads((tmp_path / "d3b" / "config.json").read_text())["depth"] == 3

    assert run("x", "--only", "train", "--init", str(tmp_path / "d3"), "--depth", "2") == 2
    assert run("x", "--only", "train", "--init", str(tmp_path / "d2"), "--depth", "2", "--new-steps-only") == 2
    assert not (tmp_path / "x").exists()


def test_parts_collect_more_then_train_on_some(model_folder, tmp_path, capsys):
    """Each collection run is one part of the training split; --parts trains on some."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_selfspec.training.data import (
        CollectSettings,
        PromptSource,
        WorkState,
        collect_split,
        load_split,
        work_key,
    )
    from hf_selfspec.training.train import examples

    prompts, work = write_prompts(tmp_path / "p.jsonl"), tmp_path / "replies"
    work.mkdir()
    model = AutoModelForCausalLM.from_pretrained(model_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    source, settings = PromptSource(prompts), CollectSettings(batch_size=4, max_new_tokens=16)
    state = WorkState.open(work, work_key(model, source, settings))
    # part 0: one batch (max_positions stops it, as a spent budget would)
    collect_split(model, tokenizer, source, "train", work, state, settings, 60.0, max_positions=1, progress=False)
    base = args(model_folder, tmp_path / "heads", prompts, "--work", str(work))
    assert main(base + ["--only", "collect"]) == 0  # part 1: the rest (and the held-out split)
    state = WorkState.open(work, work_key(model, source, settings))
    runs = state.splits["train"].runs
    assert [r["files"] for r in runs] == [1, 3] and sum(r["replies"] for r in runs) == 10
    replies = [len(load_split(work, state, "train", [k])["ids"]) for k in (0, 1)]
    assert replies == [r["replies"] for r in runs]

    assert main(base + ["--only", "train", "--parts", "1", "--depth", "2"]) == 0
    training = json.loads((tmp_path / "heads" / "config.json").read_text())["training"]
    assert training["parts"] == [1]
    assert training["train_positions"] == len(examples(load_split(work, state, "train", [1]), 2))
    capsys.readouterr()
    assert main(base + ["--only", "train", "--parts", "0,2"]) == 2
    assert "--parts 2: the training split has parts 0-1" in capsys.readouterr().err


def test_teacher_forced_conversations(model_folder, tmp_path):
    """--teacher-forced: the conversations' own assistant turns, one forward each: ids are
    the conversation's tokens, argmax the model's token after each; its work folder is
    not mixed with the model's own replies."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    path, work = tmp_path / "chats.jsonl", tmp_path / "tf"
    with path.open("w", encoding="utf-8") as f:
        for p in PROMPTS:  # the model's own replies as the assistant turns: text it agrees with
            messages = [{"role": "user", "content": p}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
            with torch.no_grad():  # greedy, without generate's per-call set-up
                for _ in range(16):
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            messages.append({"role": "assistant", "content": tokenizer.decode(ids[-16:])})
            f.write(json.dumps({"messages": messages}) + "\n")
    base = args(model_folder, tmp_path / "heads", path, "--work", str(work), "--teacher-forced")
    assert main(base + ["--depth", "2"]) == 0
    training = json.loads((tmp_path / "heads" / "config.json").read_text())["training"]
    assert training["data"] == "tf" and training["collection"]["train_replies"] == 10
    assert "teacher-forced positions" in (tmp_path / "heads" / "README.md").read_text()
    part = torch.load(work / "train-00000.pt")
    ids, argmax, mask = part["ids"][0], part["argmax"][0], part["mask"][0]
    with torch.no_grad():
        assert torch.equal(model(ids[None].long()).logits[0].argmax(-1).int(), argmax)
    assert 8 <= int(mask.sum()) < len(ids)  # the assistant turn only
    own = args(model_folder, tmp_path / "heads", path, "--work", str(work))
    assert main(own) == 2  # replies of another kind: refused, not mixed in


@pytest.mark.parametrize("extra, message", [
    (["--new-steps-only"], "--new-steps-only needs --init"),
    (["--only", "collect", "--parts", "1"], "--parts: training flags, not for --only collect"),
    (["--init", "no_such_heads"], "--init no_such_heads: no heads there"),
    (["--epochs", "0"], "--epochs and --train-batch must be >= 1"),
])
def test_training_flags_are_checked_before_the_model_loads(tmp_path, capsys, extra, message):
    assert main(["no_such_model", "--out", str(tmp_path / "o"), "--minutes", "1", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_bad_files_and_budgets_are_refused_before_the_model_loads(tmp_path, capsys):
    """An infinite --minutes (a traceback from the progress bar), a file where --out or
    --work must be a folder (NotADirectoryError), a bad prompts line or exit heads as --init
    (refused only after the model had loaded): each one line, before loading the model
    (no_such_model would otherwise be the error)."""
    from hf_selfspec.heads import exit_heads_path

    (tmp_path / "file").write_text("x")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\nnot json\n')
    good = write_prompts(tmp_path / "p.jsonl")
    cases = [
        (["--minutes", "inf"], "--minutes must be a finite number > 0, got inf"),
        (["--out", str(tmp_path / "file")], "a file is in the way of this folder"),
        (["--out", str(tmp_path / "file" / "sub")], "a file is in the way of this folder"),
        (["--work", str(tmp_path / "file")], f"--work {tmp_path / 'file'}: a file is in the way"),
        (["--prompts", str(tmp_path / "bad.jsonl")], "bad.jsonl, line 2: not valid JSON"),
        (["--init", str(exit_heads_path())], "field 'kind' is 'exit_head', not 'top_draft'"),
        (["--lr", "inf"], "--lr a finite number > 0"),
    ]
    for extra, message in cases:
        argv = ["no_such_model", "--out", str(tmp_path / "o"), "--minutes", "1",
                "--prompts", str(good), *extra]
        assert main(argv) == 2, extra
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (extra, err)


def test_parts_flag_syntax():
    from hf_selfspec.training.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["m", "--out", "o", "--minutes", "1", "--parts", "0,2-4"]).parts == (0, 2, 3, 4)
    with pytest.raises(SystemExit):
        parse(["m", "--out", "o", "--minutes", "1", "--parts", "two"])


def test_examples_align_chain_inputs_and_targets():
    """Per position t, the chain's inputs are the next tokens of the text, its targets the
    model's argmaxes there, and `agree` says where the text is the model's own; positions
    too close to the reply's end or masked out are left out."""
    from hf_selfspec.training.train import examples

    g = torch.Generator().manual_seed(0)
    data = {"ids": [], "argmax": [], "final": [], "mask": []}
    for R in (9, 5):
        final = torch.randn(R, 6, generator=g).half()
        data["final"].append(final)
        data["argmax"].append(final.float().argmax(-1).int())  # the "model's" greedy token
        data["ids"].append(torch.randint(0, 6, (R,), generator=g, dtype=torch.int32))
        mask = torch.ones(R, dtype=torch.bool)
        mask[-1] = False
        mask[1] = False
        data["mask"].append(mask)
    D = 3
    ex = examples(data, D)
    expected_t = [(0, t) for t in range(9 - D) if t != 1] + [(1, t) for t in range(5 - D) if t != 1]
    assert len(ex) == len(expected_t)
    for row, (r, t) in enumerate(expected_t):
        ids, arg, fin = data["ids"][r], data["argmax"][r], data["final"][r]
        assert torch.equal(ex.f[row], fin[t])
        for i in range(D):
            assert ex.x[row, i] == ids[t + 1 + i] and ex.y[row, i] == arg[t + 1 + i]
            assert bool(ex.agree[row, i]) == bool(ids[t + 1 + i] == arg[t + i])


def test_the_shipped_recipe_is_train_heads_commands(tmp_path):
    """scripts/head_study.py's steps parse as `hf-selfspec train-heads` arguments, and only
    the last one writes the final heads."""
    import importlib.util
    from pathlib import Path

    from hf_selfspec.training.cli import build_parser

    spec = importlib.util.spec_from_file_location(
        "head_study", Path(__file__).parent.parent / "scripts" / "head_study.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    steps = study.recipe(tmp_path / "final", tmp_path / "work")
    parsed = [build_parser().parse_args(["default", *step]) for step in steps]
    assert [a.out for a in parsed].count(tmp_path / "final") == 1 and parsed[-1].out == tmp_path / "final"
    assert parsed[-1].parts == (2, 3, 4, 5) and parsed[-1].init is not None
    assert sum(a.only == "collect" for a in parsed) == 8 and sum(a.new_steps_only for a in parsed) == 1


def test_help_keeps_its_example_lines(capsys):
    """The module docstring is the --help text: a shell continuation written as a bare
    backslash at a line's end joined the example's two lines into one with a run of spaces."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--minutes 10 \\\n        --init my_heads" in out
    assert not any("  --" in line.strip() for line in out.splitlines()
                   if line.lstrip().startswith("hf-selfspec train-heads")), out
