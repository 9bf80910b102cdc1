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
