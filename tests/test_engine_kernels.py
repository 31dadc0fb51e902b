"""The lean model's building blocks on random tensors: int8 linears and rotary embeddings.

What batching relies on is checked bit for bit: a decode row's output is the same alone or batched.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from assistant.engine.model import (  # noqa: E402
    FBGEMM_MAX_ROWS,
    Linear,
    RowSplit,
    apply_rope,
    fbgemm_matches_int_mm,
    fbgemm_pack,
)


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 256) * 0.05, torch.randn(300) * 0.1
    return weight, bias, Linear(weight, bias, "int8", torch.float32)


def _reference(x, weight, bias, int8: Linear):
    """Exact integer arithmetic in float64: per-row int8 activations times per-channel int8 weights."""
    x_scale = x.abs().amax(dim=1, keepdim=True) / 127.0
    xq = torch.round(x / x_scale).double()
    w_scale = weight.abs().amax(dim=1).double() / 127.0
    return (xq @ int8.weight.double().t()) * x_scale.double() * w_scale + bias.double()


def test_fbgemm_is_used_where_it_is_exact(layer):
    _, _, int8 = layer
    assert (int8.packed is not None) == fbgemm_matches_int_mm()
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX"):  # x86 with AVX-512 (VNNI here)
        assert int8.packed is not None


def test_both_kernels_give_bit_identical_rows(layer):
    """Prefill-sized steps run torch._int_mm, small steps fbgemm: a row must not notice which."""
    _, _, int8 = layer
    x = torch.randn(3 * FBGEMM_MAX_ROWS, 256) * 4
    x[0] = x[0].abs()  # all-positive activations: the int16-saturation worst case
    big = int8._int8(x, None)  # _int_mm
    for i in range(0, x.size(0), FBGEMM_MAX_ROWS):
        assert torch.equal(int8._int8(x[i:i + FBGEMM_MAX_ROWS].clone(), None), big[i:i + FBGEMM_MAX_ROWS])  # fbgemm


def test_one_pass_rows_match_exact_integer_arithmetic(layer):
    weight, bias, int8 = layer
    x = torch.randn(5, 256) * 3
    got = int8._int8(x, None).double() + bias.double()
    want = _reference(x, weight, bias, int8)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    fp32 = x @ weight.t() + bias  # and int8 stays close to the unquantized product
    assert ((int8(x) - fp32).abs().max() / fp32.abs().max()).item() < 0.03


def test_residual_pass_brings_generated_rows_close_to_unquantized_activations(layer):
    weight, bias, int8 = layer
    x = torch.randn(4, 256)
    x[:, 7] *= 200  # an outlier channel, as LLM activations have: one pass loses the small channels
    w8 = int8.weight.float() * (weight.abs().amax(dim=1, keepdim=True) / 127.0)  # the int8 weights, dequantized
    weight_only = x @ w8.t() + bias  # what int8 weights with exact activations give
    one_pass = int8._int8(x, None) + bias
    two_pass = int8(x)  # no RowSplit: every row is refined, like lm_head rows and generated tokens
    err = lambda y: ((y - weight_only).abs().max() / weight_only.abs().max()).item()  # noqa: E731
    assert err(two_pass) < 1e-3 < err(one_pass)
    assert err(two_pass) * 50 < err(one_pass)


def test_decode_row_is_bitwise_the_same_alone_or_batched(layer):
    _, _, int8 = layer
    x = torch.randn(8, 256)
    x[3] *= 50  # a row with a very different range must not change the others' scales
    batched = int8(x)  # 16 rows with the residual pass: _int_mm
    for i in range(8):
        assert torch.equal(int8(x[i:i + 1].clone())[0], batched[i])  # 2 rows: fbgemm


def test_mixed_step_refines_only_generated_rows(layer):
    _, _, int8 = layer
    x = torch.randn(6, 256)
    rows = RowSplit.from_mask(torch.tensor([True, True, True, False, False, True]))
    mixed = int8(x, rows)
    assert torch.equal(mixed[rows.prompt], int8(x[rows.prompt], RowSplit.from_mask(torch.ones(4, dtype=torch.bool))))
    assert torch.equal(mixed[rows.decode], int8(x[rows.decode]))


def test_mixed_step_without_fbgemm_computes_prompt_and_decode_rows_with_their_own_kernels(layer):
    weight, bias, _ = layer
    int8 = Linear(weight, bias, "int8", torch.float32)
    int8.packed = None  # what a build without fbgemm gets: weight-only kernel for generated tokens
    x = torch.randn(6, 256)
    rows = RowSplit.from_mask(torch.tensor([True, True, True, False, False, True]))
    mixed = int8(x, rows)
    prompt_only = int8(x[rows.prompt], RowSplit.from_mask(torch.ones(4, dtype=torch.bool)))
    assert torch.equal(mixed[rows.prompt], prompt_only)
    assert torch.equal(mixed[rows.decode], int8(x[rows.decode]))


def test_fallback_kernel_without_fbgemm(layer):
    weight, bias, int8 = layer
    fallback = Linear(weight, bias, "int8", torch.float32)
    fallback.packed = None  # what a build without fbgemm gets
    x = torch.randn(2, 256)
    assert torch.allclose(fallback(x), int8(x), rtol=0.05, atol=0.05)


def test_zero_row_does_not_divide_by_zero(layer):
    _, bias, int8 = layer
    out = int8(torch.zeros(1, 256))
    assert torch.isfinite(out).all() and torch.allclose(out[0], bias, atol=1e-6)


def test_fbgemm_pack_restores_the_engine_setting():
    before = torch.backends.quantized.engine
    fbgemm_pack(torch.ones(4, 8, dtype=torch.int8), torch.ones(4))
    assert torch.backends.quantized.engine == before


def test_rope_with_signed_sin_equals_rotate_half():
    torch.manual_seed(1)
    x = torch.randn(3, 4, 8)
    angles = torch.randn(3, 1, 4)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    rotate_half = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    signed = sin * torch.cat([-torch.ones(4), torch.ones(4)])
    assert torch.allclose(apply_rope(x, cos, signed), x * cos + rotate_half * sin, atol=1e-6)
