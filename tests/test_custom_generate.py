"""custom_generate/: laid out and loaded as transformers' "custom generation methods" require,
from local folders built the way docs/custom_generate.md publishes them:

1. a stock model: generate(custom_generate=<folder>, trust_remote_code=True);
2. a model folder that carries its own custom_generate/: from_pretrained(trust_remote_code=True)
   makes its generate() hf_selfspec's.

Greedy equals HF greedy token for token in both; seeded sampling is reproducible; heads
passed with selfspec_heads draft.
"""

from __future__ import annotations

import ast
import contextlib
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from hf_selfspec.heads import save_heads
from hf_selfspec.heads.top import random_top_heads

SOURCE = Path(__file__).resolve().parent.parent / "custom_generate"
METHOD_FILES = ("generate.py", "requirements.txt")
GREEDY = {"max_new_tokens": 20, "do_sample": False, "pad_token_id": 0}


def hub_layout(repo: Path) -> Path:
    """`repo` laid out as the Hub repo of docs/custom_generate.md: the card at the root,
    the method in custom_generate/."""
    (repo / "custom_generate").mkdir(parents=True)
    shutil.copy(SOURCE / "README.md", repo / "README.md")
    for name in METHOD_FILES:
        shutil.copy(SOURCE / name, repo / "custom_generate" / name)
    return repo


def inputs(seed=0, length=30):
    ids = torch.randint(3, 24, (1, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_layout_and_card_are_what_transformers_documents():
    """generate.py defines generate(model, ...); requirements name the package; the card
    (the Hub repo's README) carries library_name transformers and the custom_generate tag
    and says sampling is exact, not refused."""
    from huggingface_hub import ModelCard

    tree = ast.parse((SOURCE / "generate.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "generate")
    assert fn.args.args[0].arg == "model"
    assert "hf-selfspec" in (SOURCE / "requirements.txt").read_text().split()
    card = ModelCard.load(SOURCE / "README.md")
    assert card.data.library_name == "transformers" and "custom_generate" in card.data.tags
    assert "exact speculative" in card.text and "sampling" in card.text
    assert "selfspec_heads" in card.text  # its one extra argument is documented


def test_stock_model_with_the_method_folder(tmp_path):
    """Path 1 from a folder laid out as the Hub repo: greedy is HF greedy; heads given
    with selfspec_heads draft and stay exact; seeded sampling repeats itself."""
    repo = hub_layout(tmp_path / "selfspec_generate_stock")
    ref = tiny_model("llama", seed=6, layers=4)
    expected = ref.generate(**inputs(1), **GREEDY)

    stock = tiny_model("llama", seed=6, layers=4)
    got = stock.generate(**inputs(1), custom_generate=str(repo), trust_remote_code=True,
                         selfspec_heads=False, **GREEDY)
    assert torch.equal(got, expected)
    assert stock.selfspec_stats.new_tokens == 20

    with_heads = tiny_model("llama", seed=6, layers=4)
    heads = save_heads(random_top_heads(with_heads), tmp_path / "heads")
    got = with_heads.generate(**inputs(1), custom_generate=str(repo), trust_remote_code=True,
                              selfspec_heads=str(heads), **GREEDY)
    assert torch.equal(got, expected)
    assert with_heads.selfspec_stats.drafted > 0

    sample = {"max_new_tokens": 16, "do_sample": True, "temperature": 0.8, "top_k": 20,
              "pad_token_id": 0}
    draws = []
    for _ in range(2):
        torch.manual_seed(3)
        draws.append(stock.generate(**inputs(2), custom_generate=str(repo),
                                    trust_remote_code=True, **sample))
    assert torch.equal(draws[0], draws[1]) and draws[0].shape[1] == 30 + 16


def test_model_folder_with_its_own_custom_generate(tmp_path):
    """Path 2: save_pretrained + custom_generate/ copied in; loaded with trust_remote_code,
    the model's generate() is hf_selfspec's (greedy equal to the same folder loaded without
    it), again on a second call; sampling works through it."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "selfspec_generate_pair"
    tiny_model("llama", seed=8, layers=4).save_pretrained(folder)
    hub_layout(folder)
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert "generate" not in plain.__dict__  # without trust_remote_code: HF's own
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert "generate" in model.__dict__  # transformers set the repo's method on the instance
    for seed in (4, 5):  # the second call reuses the attached engine
        first = pytest.warns(UserWarning, match="prompt lookup only")  # no heads for it
        with first if seed == 4 else contextlib.nullcontext():
            got = model.generate(**inputs(seed), **GREEDY)
        assert torch.equal(got, plain.generate(**inputs(seed), **GREEDY))
        assert model.selfspec_stats.new_tokens == 20
    assert "generate" in model.__dict__  # still the repo's method after the attach

    torch.manual_seed(7)
    out = model.generate(**inputs(6), max_new_tokens=12, do_sample=True, top_p=0.9, pad_token_id=0)
    assert out.shape == (1, 42) and model.selfspec_stats.new_tokens == 12



def test_selfspec_heads_is_honoured_on_every_call(tmp_path):
    """selfspec_heads is a per-call argument: a later call naming other heads attaches them
    (they were silently ignored once the first call had attached), a missing folder is
    refused there too; heads the user attached themselves stay when a call names none."""
    import hf_selfspec

    repo = hub_layout(tmp_path / "method")
    model = tiny_model("llama", seed=6, layers=4)
    heads = save_heads(random_top_heads(model), tmp_path / "heads")
    call = dict(custom_generate=str(repo), trust_remote_code=True, **inputs(1), **GREEDY)
    expected = tiny_model("llama", seed=6, layers=4).generate(**inputs(1), **GREEDY)
    assert torch.equal(model.generate(**call, selfspec_heads=False), expected)
    assert model._selfspec.heads is None
    assert torch.equal(model.generate(**call, selfspec_heads=str(heads)), expected)
    assert model._selfspec.heads is not None and model.selfspec_stats.drafted > 0
    with pytest.raises(FileNotFoundError, match="no_such_heads"):
        model.generate(**call, selfspec_heads=str(tmp_path / "no_such_heads"))
    assert torch.equal(model.generate(**call, selfspec_heads=False), expected)
    assert model._selfspec.heads is None
    hf_selfspec.attach_heads(model, str(heads))  # the user's own attach, then no selfspec_heads
    assert torch.equal(model.generate(**call), expected) and model._selfspec.heads is not None
