"""The LM head's argmax screen (engine/screen.py): always torch.argmax of the float32
logits, or no answer (the engine then computes the float32 logits)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from hf_selfspec.kernels.cpu_rows import build_error, load_rows_linear, load_rows_screen, screen_uses_vnni, use_avx512

from hf_selfspec.engine import screen as screen_module
from hf_selfspec.engine.core import Engine, EngineConfig
from hf_selfspec.engine.screen import ScreenedArgmax, quantize_rows, screen_refusal


@pytest.fixture(scope="module")
def product():
    kernel = load_rows_linear()
    if kernel is None:
        pytest.skip(f"the C++ row kernel does not build here: {build_error()}")
    return lambda x, w: kernel(x.contiguous(), w)


@pytest.fixture(scope="module")
def screen_of():
    kernel = load_rows_screen()
    if kernel is None:
        pytest.skip(f"the C++ row kernel does not build here: {build_error()}")
    return lambda w: ScreenedArgmax(w, kernel)


def full_argmax(product, x, w):
    return product(x, w).argmax(-1)


@pytest.fixture(params=["default", "8-lane"])
def isa(request):
    """Each test on the CPU's own screen product (on AVX-512 VNNI: x quantised to 16 bits) and
    on the 8-lane float32 product every AVX2 CPU runs."""
    wide = use_avx512()
    if request.param == "8-lane":
        use_avx512(False)
    yield request.param
    use_avx512(wide)


def test_screen_equals_the_float32_argmax_at_every_scale(product, screen_of, isa):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3000, 72, generator=gen) * 0.05
    w[7] *= 40.0  # one row far larger than the rest: its bound is its own, not every token's
    screen = screen_of(w)
    answered = 0
    for scale in (0.01, 1.0, 30.0, 300.0):
        x = torch.randn(8, 72, generator=gen) * scale
        x[3, 5] *= 50.0  # an outlier dimension, as hidden states have: x's scale takes it
        got = screen.argmax(x)
        if got is not None:
            answered += 1
            assert torch.equal(got, full_argmax(product, x, w))
    assert answered >= 3
    # 1..12 rows (every tile width and two passes of 8), odd K (masked tails)
    w = torch.randn(1000, 45, generator=gen)
    screen = screen_of(w)
    for n in (1, 2, 3, 5, 8, 12):
        x = torch.randn(n, 45, generator=gen)
        assert torch.equal(screen.argmax(x), full_argmax(product, x, w)), n


def test_the_bound_keeps_a_token_the_quantised_x_ranks_lower(product, screen_of, isa):
    """x with one huge dimension: its 16-bit quantisation step (1e4 / 32767) rounds the other
    two to 3 and 4 steps, which ranks token 1 first (100 * 4 > 127 * 3) where float32 ranks
    token 0 (127 * 1.0 > 100 * 1.25). The weights are exact in int8, so only the x term of the
    bound (qnorm * ||x - s_x x_q||) keeps token 0 a candidate."""
    w = torch.tensor([[0.0, 127.0, 0.0], [0.0, 0.0, 100.0], [0.0, 0.0, 0.0]])
    x = torch.tensor([[1e4, 1.0, 1.25]])
    step = 1e4 / 32767
    x_q = torch.round(x / step) * step
    assert int((x_q @ w.T).argmax()) == 1 and int(full_argmax(product, x, w)[0]) == 0
    assert screen_of(w).argmax(x).tolist() == [0]
    if isa == "8-lane":
        assert screen_uses_vnni() is False  # float32 x: the case is plain there


def test_the_bound_holds_for_every_token():
    """|x . w_v - s_v (x . q_v)| <= b_v ||x|| for every token and random x, with room to
    spare only as the float32 rounding needs; and the bound is per token (the largest row
    has the largest bound, most are far smaller)."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(2000, 96, generator=gen) * 0.05
    w[3] *= 50.0
    q, scale, bound, _ = quantize_rows(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    x = torch.randn(64, 96, generator=gen, dtype=torch.float64)
    exact = x @ w.double().T
    approx = (x @ q.double().T) * scale.double()
    assert bool(((exact - approx).abs() <= bound.double() * x.norm(dim=1, keepdim=True)).all())
    assert int(bound.argmax()) == 3 and float(bound.median()) < float(bound[3]) / 20


def test_near_ties_are_decided_by_the_float32_rows(product, screen_of):
    """Rows that quantize to the same int8 row but differ in float32: their int8 logits tie,
    their float32 ones do not, and the higher id wins (the int8 argmax would give the lower
    id); rows equal in float32 tie to the lowest id, as torch.argmax does."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=gen) * 0.05
    x = torch.rand(2, 32, generator=gen) + 0.1
    w[10] = 1.0
    w[50] = 1.0  # an exact float32 tie with row 10
    w[40] = 1.0
    w[40, 5] = 1.0 - 1e-3  # the same int8 row as row 10 (scale 1/127); float32: slightly lower
    w[40, 6] = 1.0 + 1e-3  # ... and slightly higher: better wherever x6 > x5
    q = quantize_rows(w)[0]
    assert torch.equal(q[40], q[10])
    x[:, 6] = x[:, 5] + 0.5
    assert screen_of(w).argmax(x).tolist() == full_argmax(product, x, w).tolist() == [40, 40]
    w[40] = 0.0
    assert screen_of(w).argmax(x).tolist() == full_argmax(product, x, w).tolist() == [10, 10]


def test_the_bound_keeps_a_token_the_int8_logits_rank_lower(product, screen_of):
    """int8 logits rank token 0 first (its small weight rounds up to a whole step), float32
    logits token 1: the bound keeps token 1 a candidate and the float32 rows decide."""
    w = torch.tensor([[1.0, 0.006], [1.0, 0.0075], [0.5, 0.0]])
    x = torch.tensor([[0.0, 1.0]])
    q, scale = quantize_rows(w)[:2]
    int8 = (x @ q.float().T) * scale
    assert int(int8[0].argmax()) == 0 and int(full_argmax(product, x, w)[0]) == 1
    assert screen_of(w).argmax(x).tolist() == [1]


def test_no_answer_where_the_screen_cannot_say(product, screen_of):
    w = torch.randn(500, 16, generator=torch.Generator().manual_seed(2))
    screen = screen_of(w)
    x = torch.randn(3, 16)
    x[1, 4] = float("nan")
    assert screen.argmax(x) is None
    same = torch.zeros(5, 16)
    same[:, 0] = 1.0
    flat = screen_of(same.repeat(screen_module.MAX_CANDIDATES // 5 + 1, 1))  # too many equal logits to screen
    assert flat.argmax(torch.ones(1, 16)) is None
    bad = w.clone()
    bad[3, 0] = float("inf")  # a non-finite weight: no copy, no answer
    assert screen_of(bad).argmax(x) is None
    huge = w.clone()
    huge[3, 0] = 1e6  # any finite magnitude: the row's scale takes it
    assert torch.equal(screen_of(huge).argmax(x[[0, 2]]), full_argmax(product, x[[0, 2]], huge))


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


def test_both_int8_products_give_the_float32_argmax(product, screen_of):
    """The screen's int8 product runs in 16 lanes on AVX-512 and in the 8-lane tiles
    elsewhere (rows_isa(0) forces them here): either way, the float32 argmax."""
    from hf_selfspec.kernels.cpu_rows import _load_module

    module = _load_module()
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(4001, 72, generator=gen) * 0.05  # an odd vocabulary: a lone last row
    x = torch.randn(11, 72, generator=gen)  # more rows than one 8-row pass
    screen = screen_of(w)
    before = module.rows_isa(-1)
    try:
        for isa in (0, 1):
            module.rows_isa(isa)
            assert torch.equal(screen.argmax(x), full_argmax(product, x, w))
    finally:
        module.rows_isa(1 if before else 0)


def test_a_big_lm_heads_screen_waits_for_the_second_request(monkeypatch, product):
    """An int8 copy over EAGER_COPY_BYTES is made at the engine's second request, not its
    first (a big model's first call does not write it); both requests equal HF greedy."""
    from conftest import hf_greedy

    from hf_selfspec import attach_heads

    monkeypatch.setattr(screen_module, "EAGER_COPY_BYTES", 1024)
    model = tiny_model("llama", seed=6, layers=2)
    prompt = list(range(5, 25))
    expected = hf_greedy(model, prompt, 16)
    attach_heads(model, heads=False)
    ids = torch.tensor([prompt])
    for request in range(2):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             assistant="self", pad_token_id=0)
        assert out[0, len(prompt):].tolist() == expected
        engine = model._selfspec.engine
        assert (engine.screen is None) == (request == 0), request
