"""Top-layer draft heads: repo round trip, refusal for another model, generate parity."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from hf_selfspec import DecodeConfig, attach_heads
from hf_selfspec.heads.repo import load_heads, read_kind, save_heads
from hf_selfspec.heads.top import TOP_KIND, random_top_heads


def test_round_trip_is_bit_exact(tmp_path):
    model = tiny_model("llama", seed=0, layers=4)
    heads = random_top_heads(model)
    save_heads(heads, tmp_path, thresholds=[0.1, 0.2])
    assert read_kind(tmp_path) == "top_draft"
    loaded = load_heads(tmp_path, model, kind=TOP_KIND)
    assert loaded.calibration.thresholds == [0.1, 0.2]
    f = torch.randn(1, model.config.hidden_size)
    assert loaded.draft(f[0], 5, 2, [0.0, 0.0]) == heads.draft(f[0], 5, 2, [0.0, 0.0])


def test_deepened_heads_keep_their_steps_and_copy_the_last(tmp_path):
    """deepened(3): the first two steps draft exactly as before, step 2 starts as a copy of
    step 1, and the deeper heads round-trip through the repo format."""
    model = tiny_model("llama", seed=0, layers=4)
    heads = random_top_heads(model)
    deeper = heads.deepened(3)
    assert deeper.config.depth == 3 and len(deeper.steps) == 3
    assert torch.equal(deeper.steps[2].down.weight, heads.steps[1].down.weight)
    f = torch.randn(model.config.hidden_size)
    assert deeper.draft(f, 5, 2, [0.0] * 3) == heads.draft(f, 5, 2, [0.0, 0.0])
    assert len(deeper.draft(f, 5, 3, [0.0] * 3)) == 3
    save_heads(deeper, tmp_path)
    assert load_heads(tmp_path, model, kind=TOP_KIND).draft(f, 5, 3, [0.0] * 3) == deeper.draft(f, 5, 3, [0.0] * 3)
    with pytest.raises(ValueError, match="not deeper"):
        heads.deepened(2)


def test_heads_for_another_model_are_refused(tmp_path):
    save_heads(random_top_heads(tiny_model("llama", seed=0, layers=4)), tmp_path)
    with pytest.raises(ValueError, match="fingerprint"):
        attach_heads(tiny_model("llama", seed=1, layers=4), str(tmp_path))


def test_corrupt_and_missing_files(tmp_path):
    model = tiny_model("llama", seed=0, layers=4)
    save_heads(random_top_heads(model), tmp_path)
    weights = tmp_path / "heads.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt"):
        load_heads(tmp_path, model, kind=TOP_KIND)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="heads.safetensors"):
        load_heads(tmp_path, model, kind=TOP_KIND)


def test_generate_with_top_heads_matches_hf_greedy(tmp_path):
    ref = tiny_model("qwen3", seed=2, layers=4)
    model = tiny_model("qwen3", seed=2, layers=4)
    save_heads(random_top_heads(model), tmp_path, thresholds=[0.0, 0.0])
    attach_heads(model, str(tmp_path), decode=DecodeConfig(lookup="first"))
    drafted = 0
    for seed in range(3):
        ids = torch.randint(3, 40, (1, 25), generator=torch.Generator().manual_seed(seed))
        kw = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
        expected = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        assert torch.equal(model.generate(ids, assistant="self", **kw), expected)
        drafted += model.selfspec_stats.drafted
    assert drafted > 0


def test_loaded_heads_object_for_another_model_is_refused():
    heads = random_top_heads(tiny_model("llama", seed=0, layers=4))
    with pytest.raises(ValueError, match="fingerprint"):
        attach_heads(tiny_model("llama", seed=1, layers=4), heads)


def test_card_reports_own_generation_figures_and_fine_tuning(tmp_path):
    """A card of heads fine-tuned on the model's own replies leads with the own-eval figures
    (the text the decoder sees), keeps the teacher-forced ones, and says what was fine-tuned."""
    import yaml

    heads = random_top_heads(tiny_model("llama", seed=0))
    heads.config.training = {
        "step0_top1_given_reached": 0.41, "step1_top1_given_reached": 0.39, "tau_thr0.0": 1.55,
        "own_eval_step0_top1_given_reached": 0.47, "own_eval_step1_top1_given_reached": 0.45,
        "own_eval_tau_thr0.0": 1.68, "train_positions": 120000, "data": "own", "epochs": 3,
        "init_training": {"train_positions": 679841, "data": "tf"}, "reproduce": "python x.py",
        "end_to_end": {"setup": "2-core CPU", "command": "python bench.py",
                       "rows": {"chat": {"tau": 1.7, "speedup": 1.9}}},
        "own_eval_dynamic_tree_tau": {"beam": 4, "children": 4, "tree": {"1": 1.5, "3": 2.01},
                                      "chain": {"1": 1.5, "3": 1.92}},
    }
    save_heads(heads, tmp_path)
    card = (tmp_path / "README.md").read_text()
    metadata = yaml.safe_load(card.split("---")[1])
    assert metadata["library_name"] == "hf_selfspec" and metadata["base_model_relation"] == "adapter"
    assert metadata["base_model"] == "random" and "draft-heads" in metadata["tags"]
    meta = metadata["hf_selfspec"]
    assert meta["top1_agreement_per_step"] == [0.47, 0.45]
    assert meta["expected_tau_full_chain"] == 1.68
    assert card.index("own greedy replies to held-out") < card.index("teacher-forced, positions")
    assert "| 0 | 0.41 |" in card and "| 0 | 0.47 |" in card
    assert "fine-tuned from heads trained on 679841 teacher-forced" in card
    assert "Reproduce: `python x.py`" in card
    assert "| chat | 1.7 | 1.9x |" in card and "Reproduce: `python bench.py`" in card
    assert "| 3 | 2.01 | 1.92 |" in card and "4 likeliest nodes of each step" in card
    # the chain's figure says what it is, and where to measure what decoding gets
    assert "no\nconfidence threshold: 1.68" in card and "not what decoding gets" in card


def test_float16_storage_round_trip(tmp_path):
    """storage_dtype='float16' (the shipped heads): half the file, the heads run in the
    model's dtype with their weights rounded to float16, and a bad dtype is refused."""
    from hf_selfspec.heads.top import TopHeadsConfig

    model = tiny_model("llama", seed=0, layers=4)
    heads = random_top_heads(model)
    save_heads(heads, tmp_path / "fp32")
    heads.config.storage_dtype = "float16"
    save_heads(heads, tmp_path / "fp16")
    size = lambda d: (tmp_path / d / "heads.safetensors").stat().st_size  # noqa: E731
    assert size("fp16") < 0.6 * size("fp32")
    loaded = load_heads(tmp_path / "fp16", model, kind=TOP_KIND)
    assert loaded.out_norm.dtype == torch.float32
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(p.half().float())
    f = torch.randn(model.config.hidden_size)
    assert loaded.draft(f, 5, 2, [0.0, 0.0]) == heads.draft(f, 5, 2, [0.0, 0.0])
    with pytest.raises(ValueError, match="storage_dtype"):
        TopHeadsConfig.from_dict({**heads.config.to_dict(), "storage_dtype": "int8"})




def _kernel_model_and_heads(load):
    """A compiled C++ row-kernel function (skip where the kernel does not build), a tiny
    float32 model and random top heads bound to it."""
    from hf_selfspec.kernels.cpu_rows import build_error

    fn = load()
    if fn is None:
        pytest.skip(f"the C++ row kernel does not build here: {build_error()}")
    model = tiny_model("llama", seed=0, layers=4)
    return fn, model, random_top_heads(model)


def test_drafting_reads_16bit_copies_kept_current():
    """On the CPU row kernel, drafting reads float16 copies of the step weights and LM-head
    rows: bit-identical to float32 arithmetic on those weights rounded to float16 (exact for
    the shipped float16-stored heads), made again after an in-place change of a weight;
    with autograd on (training) the float32 weights are used as before."""
    import torch.nn.functional as F
    from hf_selfspec.kernels.cpu_rows import load_rows_linear

    from hf_selfspec.engine.layered import rms_norm

    kernel, model, heads = _kernel_model_and_heads(load_rows_linear)
    assert heads._fast_linear is not None

    def expected(step, h, tokens, rounded):
        def w(t):
            return t.detach().half().float() if rounded else t.detach()
        s = heads.steps[step]
        linear = (lambda x, t: kernel(x.contiguous(), w(t))) if rounded else (lambda x, t: F.linear(x, t))
        x = torch.cat([rms_norm(h, s.h_norm, s.eps), rms_norm(F.embedding(tokens, heads.embed), s.e_norm, s.eps)], -1)
        h = h + linear(F.silu(linear(x, s.down.weight)), s.up.weight)
        return h, linear(rms_norm(h, heads.out_norm, heads.config.rms_norm_eps), heads.lm_rows)

    h = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([5, 9, 11])
    for step in range(2):
        with torch.no_grad():
            got, want = heads.step_logits(step, h, tokens), expected(step, h, tokens, True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with torch.no_grad():
        heads.steps[1].up.weight.mul_(-0.5)  # in place: the copy must follow
        got, want = heads.step_logits(1, h, tokens), expected(1, h, tokens, True)
    assert torch.equal(got[1], want[1])
    with torch.enable_grad():  # training: float32 weights, F.linear
        got, want = heads.step_logits(1, h, tokens), expected(1, h, tokens, False)
    assert torch.equal(got[1], want[1])


def test_fused_draft_step_proposes_what_the_pytorch_step_proposes():
    """step_top on a float32 CPU model is one C++ call (rows_draft_step) with its own
    rounding: the same k likeliest tokens as the PyTorch step where they are not near-tied,
    probabilities and states within float32 rounding, each row independent of the others,
    and ties to the lower index."""
    from hf_selfspec.kernels.cpu_rows import load_rows_draft_step

    fused, model, heads = _kernel_model_and_heads(load_rows_draft_step)
    assert heads._fused_step is not None
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(5, model.config.hidden_size, generator=gen) * 2
    tokens = torch.tensor([5, 9, 11, 200, 7])
    with torch.no_grad():
        for step in range(heads.config.depth):
            got = heads.step_top(step, h, tokens, 4)
            heads._fused_step = None
            want = heads.step_top(step, h, tokens, 4)
            heads._fused_step = fused
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-6)
            gaps = want[1][:, :-1] - want[1][:, 1:]
            assert torch.equal(got[2][gaps.min(dim=1).values > 1e-4], want[2][gaps.min(dim=1).values > 1e-4])
            assert (gaps.min(dim=1).values > 1e-4).any()
            alone = heads.step_top(step, h[2:3], tokens[2:3], 4)
            assert all(torch.equal(a[0], g[2]) for a, g in zip(alone, got))
    # equal logits: the lower index first, as a row of zeros everywhere shows
    H = model.config.hidden_size
    zero_lm = torch.zeros(16, H)
    out = fused(torch.ones(1, H), torch.ones(1, H), torch.ones(H), torch.ones(H), torch.zeros(8, 2 * H),
                torch.zeros(H, 8), torch.ones(H), zero_lm, 1e-6, 1e-6, 3)
    assert out[2].tolist() == [[0, 1, 2]]
    torch.testing.assert_close(out[1], torch.full((1, 3), 1 / 16))
    with pytest.raises(RuntimeError, match="k must be in"):
        fused(torch.ones(1, H), torch.ones(1, H), torch.ones(H), torch.ones(H), torch.zeros(8, 2 * H),
              torch.zeros(H, 8), torch.ones(H), zero_lm, 1e-6, 1e-6, 17)
