"""The hf-selfspec command on the real default model with its shipped heads."""

from __future__ import annotations

import pytest

from hf_selfspec.cli import build_parser, main


def test_help_reads_well(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for command in ("generate", "bench", "train-heads", "train-exit-heads", "push-heads"):
        assert command in out


@pytest.mark.slow
def test_generate_streams_and_matches_hf_greedy(capsys):
    prompt = "Rewrite this sentence correctly: me and him goes to the store yesterday."
    assert main(["generate", prompt, "--max-new-tokens", "24", "--no-colour", "--compare",
                 "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "[hf-selfspec] " in out and "tau" in out
    assert "identical: True" in out


@pytest.mark.slow
def test_generate_a_base_model_without_a_chat_template(tmp_path, capsys, default_model):
    """A GPT-2 folder whose tokenizer has no chat template (a base model's, as gpt2 or OPT):
    the prompt is its plain text, and the output equals HF greedy."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tokenizer = default_model
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=256,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).eval().save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    assert main(["generate", "Once upon a time", "--model", str(tmp_path), "--heads", "none",
                 "--max-new-tokens", "12", "--no-colour", "--compare", "--threads", "1"]) == 0
    assert "identical: True" in capsys.readouterr().out


@pytest.mark.slow
def test_generate_with_a_draft_model(tmp_path, capsys, default_model, monkeypatch):
    """--model and --draft-model: two HF folders of the same tokenizer (tiny random models
    with the default model's vocabulary and tokenizer); the output equals HF greedy."""
    from conftest import perturbed_copy
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = default_model
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    main_model = LlamaForCausalLM(cfg).eval()
    for folder, model in (("main", main_model), ("draft", perturbed_copy(main_model, 0.1))):
        model.save_pretrained(tmp_path / folder)
        tokenizer.save_pretrained(tmp_path / folder)
    assert main(["generate", "Say hello.", "--model", str(tmp_path / "main"), "--heads", "none",
                 "--draft-model", str(tmp_path / "draft"), "--max-new-tokens", "16", "--no-colour",
                 "--compare", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "identical: True" in out and "drafts" in out
    # the benchmark's draft-model rows on the same pair: HF assisted generation and
    # self-spec with the draft model, side by side with HF greedy
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench", Path(__file__).parent.parent / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--model", str(tmp_path / "main"), "--draft-model", str(tmp_path / "draft"),
                "--methods", "hf_greedy", "--categories", "chat", "--per-category", "1",
                "--max-new-tokens", "12", "--out", str(tmp_path / "bench.json")])
    records = json.loads((tmp_path / "bench.json").read_text())["records"]
    by_method = {r["method"]: r for r in records}
    assert set(by_method) == {"hf_greedy", "hf_assisted", "self_draft_model"}
    assert by_method["self_draft_model"]["identical"] is True
    # a "draft" model as big as the model costs a full step per draft: the measured cost
    # keeps the draft budget at 0 except for probes, so this row mostly decodes with copies
    assert by_method["self_draft_model"]["stats"]["cycles"] > 0
    # without --out the benchmark writes nothing: not in the working directory, not the
    # tracked docs/bench.json it once wrote by default
    tracked = Path(__file__).parent.parent / "docs" / "bench.json"
    before = tracked.stat().st_mtime_ns if tracked.exists() else None
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    bench.main(["--model", str(tmp_path / "main"), "--methods", "hf_greedy,hf_sample,self_sample",
                "--categories", "chat", "--per-category", "1", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert "nothing saved" in out and "self_sample is" in out and "x hf_sample" in out
    assert list((tmp_path / "cwd").iterdir()) == []
    assert (tracked.stat().st_mtime_ns if tracked.exists() else None) == before


def _entry_point(*args, timeout=300):
    """The installed `hf-selfspec` console script, as a user runs it."""
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).parent / "hf-selfspec"
    assert exe.is_file(), f"{exe} is missing: pip install -e . installs the entry point"
    import os

    env = dict(os.environ, HF_HUB_OFFLINE="1")  # a bad model name must not wait on the network
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_bench_and_train_heads_take_their_flags():
    """The script subcommands pass every flag through: --help is the script's own, and a
    real flag reaches the script (which refuses a bad value with its own message)."""
    bench = _entry_point("bench", "--help")
    assert bench.returncode == 0, bench.stderr
    # named as the user typed it, examples included, not as the script file
    assert bench.stdout.startswith("usage: hf-selfspec bench") and "scripts/bench.py" not in bench.stdout
    no_out = _entry_point("bench", "--report", "report.md")  # refused before any model loads
    assert no_out.returncode == 2 and "--report needs --out" in no_out.stderr
    for flag in ("--per-category", "--model", "--draft-model", "--methods", "--max-new-tokens"):
        assert flag in bench.stdout
    train = _entry_point("train-exit-heads", "--help")
    assert train.returncode == 0 and "--out" in train.stdout and "--model" in train.stdout
    top = _entry_point("train-heads", "--help")  # the package's own trainer (no scripts/ needed)
    assert top.returncode == 0 and "--minutes" in top.stdout and "MODEL" in top.stdout
    missing = _entry_point("train-heads", "default", "--out", "x", "--minutes", "1", "--prompts", "no_such.jsonl")
    assert missing.returncode == 2 and "no_such.jsonl" in missing.stderr and "Traceback" not in missing.stderr
    bad = _entry_point("bench", "--methods", "no_such_method", "--per-category", "1")
    assert bad.returncode == 2 and "unknown method 'no_such_method'" in bad.stderr
    separated = _entry_point("bench", "--", "--methods", "no_such_method")
    assert separated.returncode == 2 and "unknown method" in separated.stderr


def test_script_commands_without_a_source_checkout_say_so(monkeypatch, tmp_path, capsys):
    import hf_selfspec.cli as cli

    monkeypatch.setattr(cli, "_scripts_dir", lambda: tmp_path)
    assert main(["bench", "--model", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "source checkout" in err and "bench.py" in err


def test_train_exit_heads_is_in_the_package(monkeypatch, tmp_path, capsys):
    """train-exit-heads runs hf_selfspec.training.exit_heads: no scripts/ folder needed."""
    import hf_selfspec.cli as cli

    monkeypatch.setattr(cli, "_scripts_dir", lambda: tmp_path)  # as a pip install: no scripts
    with pytest.raises(SystemExit) as done:
        main(["train-exit-heads", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: hf-selfspec train-exit-heads")
    assert "--out" in out and "--model" in out


def test_errors_are_one_line_with_status_2(tmp_path):
    result = _entry_point("generate", "Hi", "--model", str(tmp_path / "no_such_model"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines[-1].startswith("hf-selfspec: error:"), result.stderr
    assert len([line for line in lines if line.startswith("hf-selfspec: error:")]) == 1
    assert "no such model folder" in lines[-1], lines[-1]


@pytest.mark.parametrize("flag", ["--model", "--draft-model"])
@pytest.mark.parametrize("value", ["./missing", "~/missing_model", "a/b/c", "/no/such/dir"])
def test_a_missing_model_folder_is_refused_before_anything_loads(monkeypatch, capsys, flag, value):
    import hf_selfspec.cli as cli

    def no_load(args):
        raise AssertionError("a model was loaded for a missing folder")

    monkeypatch.setattr(cli, "_load", no_load)
    assert main(["generate", "Hi", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}: no such model folder" in err and "Hub id ORG/NAME" in err


@pytest.mark.parametrize("flag,value", [("--max-new-tokens", "0"), ("--max-new-tokens", "-5"), ("--threads", "0")])
def test_generate_counts_are_checked_before_the_model_loads(monkeypatch, capsys, flag, value):
    import hf_selfspec.cli as cli

    def no_load(args):
        raise AssertionError("the model was loaded for a refused command line")

    monkeypatch.setattr(cli, "_load", no_load)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "Hi", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be a positive integer, got {value}" in capsys.readouterr().err


def test_warnings_wait_until_the_streamed_reply_ends(monkeypatch):
    """A warning or a log record raised while generate streams is written after the reply,
    never into the middle of its text."""
    import io
    import logging
    import warnings

    from hf_selfspec.cli import _after_the_reply
    from hf_selfspec.logs import logger

    shown = []  # what reaches the user, in order
    monkeypatch.setattr(warnings, "showwarning", lambda message, *rest: shown.append(str(message)))
    terminal = io.StringIO()
    handler = logging.StreamHandler(terminal)  # as transformers' own handler on stderr
    logging.getLogger("transformers").addHandler(handler)
    try:
        with _after_the_reply():
            warnings.warn("held warning", UserWarning)
            logger.warning("held log record")
            assert shown == [] and terminal.getvalue() == ""  # the reply is still streaming
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert shown == ["held warning"] and terminal.getvalue() == "held log record\n"
