"""The LM head's argmax screen (engine/screen.py): always torch.argmax of the float32
logits, or no answer (the engine then computes the float32 logits)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from hf_selfspec.kernels.cpu_rows import build_error, load_rows_linear, load_rows_screen

from hf_selfspec.engine import screen as screen_module
from hf_selfspec.engine.programs import Engine, EngineConfig
from hf_selfspec.engine.screen import ScreenedArgmax, screen_refusal


@pytest.fixture(scope="module")
def product():
    kernel = load_rows_linear()
    if kernel is None:
        pytest.skip(f"the C++ row kernel does not build here: {build_error()}")
    return lambda x, w: kernel(x.contiguous(), w)


@pytest.fixture(params=["pytorch", "kernel"])
def screen_of(request, product):
    """ScreenedArgmax(w, product) finding the candidates with PyTorch operations, or in the
    row kernel's rows_screen (the engine's)."""
    candidates = load_rows_screen() if request.param == "kernel" else None
    return lambda w: ScreenedArgmax(w, product, candidates)


def full_argmax(product, x, w):
    return product(x, w).argmax(-1)


def test_screen_equals_the_float32_argmax_at_every_scale(product, screen_of):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3000, 72, generator=gen) * 0.05
    screen = screen_of(w)
    answered = 0
    for scale in (0.01, 1.0, 30.0, 300.0):
        x = torch.randn(8, 72, generator=gen) * scale
        got = screen.argmax(x)
        if got is not None:
            answered += 1
            assert torch.equal(got, full_argmax(product, x, w))
    assert answered >= 3


def test_near_ties_are_decided_by_the_float32_rows(product, screen_of):
    """Rows that round to the same float16 weights but differ in float32: their float16
    logits tie, their float32 ones do not, and the higher id wins (the float16 argmax would
    give the lower id); rows equal in float32 tie to the lowest id, as torch.argmax does."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=gen) * 0.05
    x = torch.rand(2, 32, generator=gen) + 0.1
    w[10] = 1.0
    w[50] = 1.0  # an exact float32 tie with row 10
    w[40] = 1.0 + 1e-5  # float16: the same as row 10; float32: better for any positive x
    assert torch.equal(w[40].half(), w[10].half())
    assert screen_of(w).argmax(x).tolist() == full_argmax(product, x, w).tolist() == [40, 40]
    w[40] = 0.0
    assert screen_of(w).argmax(x).tolist() == full_argmax(product, x, w).tolist() == [10, 10]


def test_the_bound_keeps_a_token_the_float16_logits_rank_lower(product, screen_of):
    """float16 logits rank token 0 first (its weight rounds up), float32 logits token 1:
    the bound keeps token 1 a candidate and the float32 rows decide."""
    w = torch.tensor([[1.00049, 0.0], [1.0, 0.0006], [0.5, 0.0]])
    x = torch.ones(1, 2)
    assert float((x @ w.half().float().T)[0].argmax()) == 0
    assert screen_of(w).argmax(x).tolist() == full_argmax(product, x, w).tolist() == [1]


def test_no_answer_where_the_screen_cannot_say(product, screen_of):
    w = torch.randn(500, 16, generator=torch.Generator().manual_seed(2))
    screen = screen_of(w)
    x = torch.randn(3, 16)
    x[1, 4] = float("nan")
    assert screen.argmax(x) is None
    same = torch.zeros(5, 16)
    same[:, 0] = 1.0
    flat = screen_of(same.repeat(20, 1))  # 100 equal logits: too many to screen
    assert flat.argmax(torch.ones(1, 16)) is None
    huge = w.clone()
    huge[3, 0] = 1e6  # beyond float16: no copy, no answer
    assert screen_of(huge).argmax(x) is None


def test_an_in_place_change_of_the_weights_is_followed(product, screen_of):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(400, 24, generator=gen)
    screen = screen_of(w)
    x = torch.randn(4, 24, generator=gen)
    assert torch.equal(screen.argmax(x), full_argmax(product, x, w))
    with torch.no_grad():
        w.neg_()  # every argmax moves
    assert torch.equal(screen.argmax(x), full_argmax(product, x, w))


def test_refusals():
    w = torch.randn(10, 8)
    assert screen_refusal(w, None) is None
    assert "bias" in screen_refusal(w, torch.zeros(10))
    assert "float32" in screen_refusal(w.bfloat16(), None)
    assert "float32" in screen_refusal(w.double(), None)
    assert "contiguous" in screen_refusal(w.t(), None)


def test_engine_argmax_steps_equal_the_logits_argmax(monkeypatch, product):
    """An engine on the kernel layout screens its argmax-only steps: generate_ar equals the
    same engine without a screen, token for token, and a step that cannot be screened falls
    back to the float32 logits; an LM head over the copy's size limit gets no screen."""
    model = tiny_model("llama", seed=4, layers=2)
    engine = Engine(model, EngineConfig(width=8, capacity=256, row_layout="kernel"))
    assert engine.screen is not None
    prompt = list(range(3, 30))
    screened = engine.generate_ar(prompt, 24)
    h = engine.embed([7, 8, 9])
    logits, argmax, final = engine.verify(h, 0, engine.make_meta([27, 28, 29]), logits=False)
    assert logits is None
    _, full_argmax_, full_final = engine.verify(h, 0, engine.make_meta([27, 28, 29]))
    assert torch.equal(argmax, full_argmax_) and torch.equal(final, full_final)
    monkeypatch.setattr(engine.screen, "argmax", lambda x: None)  # cannot say: float32 logits
    assert engine.verify(h, 0, engine.make_meta([27, 28, 29]), logits=False)[0] is not None
    engine.screen = None
    assert engine.generate_ar(prompt, 24) == screened
    monkeypatch.setattr(screen_module, "MAX_COPY_BYTES", 1024)
    assert Engine(model, EngineConfig(width=8, capacity=256, row_layout="kernel")).screen is None


def test_kernel_candidates_are_the_pytorch_candidates(product):
    """rows_screen finds, row by row, the tokens the PyTorch operations find."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(5000, 72, generator=gen) * 0.05
    by_kernel = ScreenedArgmax(w, product, load_rows_screen())
    by_torch = ScreenedArgmax(w, product)
    for scale in (0.01, 1.0, 30.0, 300.0):
        x = torch.randn(6, 72, generator=gen) * scale
        assert by_kernel._candidates(x) == by_torch._candidates(x)
    near = w.clone()
    near[100:110] = near[99] + 1e-6 * torch.randn(10, 72, generator=gen)  # near ties with row 99
    x = near[99:100].repeat(3, 1) * 50.0 + 0.01 * torch.randn(3, 72, generator=gen)
    by_kernel, by_torch = ScreenedArgmax(near, product, load_rows_screen()), ScreenedArgmax(near, product)
    many = by_kernel._candidates(x)
    assert many == by_torch._candidates(x)
    assert min(len(c) for c in many) > 1  # several tokens per row: the float32 rows decide
    assert torch.equal(by_kernel.argmax(x), full_argmax(product, x, near))
