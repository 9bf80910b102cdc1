"""The hf-selfspec command on the real default model with its shipped heads."""

from __future__ import annotations

import pytest

from hf_selfspec.cli import build_parser, main


def test_help_reads_well(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for command in ("generate", "bench", "train-heads", "push-heads"):
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
def test_generate_with_a_draft_model(tmp_path, capsys, default_model):
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
