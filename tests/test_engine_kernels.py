"""The lean model's building blocks on random tensors: int8 linears and rotary embeddings.

Every int8 test runs on both decode backends: the fused native kernel (native.py) and the
PyTorch-op path (fbgemm) that machines without it use. What batching relies on is checked bit for
bit: a row's output is the same alone or batched, through the small-step kernel or torch._int_mm.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from assistant.engine import int8 as int8_module  # noqa: E402
from assistant.engine import model as model_module  # noqa: E402
from assistant.engine import native  # noqa: E402
from assistant.engine.int8 import (  # noqa: E402
    FBGEMM_MAX_ROWS,
    Linear,
    RowSplit,
    fbgemm_matches_int_mm,
    fbgemm_pack,
)
from assistant.engine.model import apply_rope  # noqa: E402
from tests.conftest import need  # noqa: E402

BACKENDS = ("native", "fbgemm")


def make_linear(weight, bias, backend: str, monkeypatch) -> Linear:
    if backend == "native":
        need(native.unavailable_reason() is not None or native.int8_kernels() is not None,
             "the native int8 kernel (build failed)", "install g++ and ninja (make test does)")
        if native.unavailable_reason() is not None:
            pytest.skip(f"native kernel: {native.unavailable_reason()}")
    else:
        monkeypatch.setattr(int8_module, "int8_kernels", lambda: None)
        if not fbgemm_matches_int_mm():
            pytest.skip("fbgemm is not exact on this CPU")
    lin = Linear(weight, bias, "int8", torch.float32)
    assert (lin.native is not None) == (backend == "native") and (lin.packed is not None) == (backend == "fbgemm")
    return lin


@pytest.fixture(scope="module")
def weights():
    torch.manual_seed(0)
    return torch.randn(300, 256) * 0.05, torch.randn(300) * 0.1  # 300 outputs: not a multiple of 64


@pytest.fixture(params=BACKENDS)
def layer(request, weights, monkeypatch):
    weight, bias = weights
    return weight, bias, make_linear(weight, bias, request.param, monkeypatch)


def small_step_rows(int8: Linear) -> int:
    """GEMM rows the small-step kernel takes (a refined row counts twice)."""
    return int8.native.MAX_ROWS if int8.native is not None else FBGEMM_MAX_ROWS


def one_pass(int8: Linear, x):
    """Prompt rows: one activation pass."""
    return int8(x, RowSplit.from_mask(torch.ones(x.size(0), dtype=torch.bool)))


def _reference(x, weight, bias, int8: Linear):
    """Exact integer arithmetic in float64: per-row int8 activations times per-channel int8 weights."""
    x_scale = x.abs().amax(dim=1, keepdim=True) / 127.0
    xq = torch.round(x / x_scale).double()
    w_scale = weight.abs().amax(dim=1).double() / 127.0
    return (xq @ int8.weight.double().t()) * x_scale.double() * w_scale + bias.double()


def test_native_kernel_is_used_exactly_where_the_cpu_has_vnni():
    linear = Linear(torch.randn(64, 32), None, "int8", torch.float32)
    if native.unavailable_reason() is None:
        need(native.int8_kernels() is not None, "the native int8 kernel (build failed)", "install g++ and ninja")
        assert linear.native is not None
    else:  # no VNNI (or ASSISTANT_NATIVE=0): nothing native may run
        assert linear.native is None and native.int8_kernels() is None


def test_fbgemm_is_used_where_it_is_exact_and_the_native_kernel_is_not(monkeypatch):
    monkeypatch.setattr(int8_module, "int8_kernels", lambda: None)
    int8 = Linear(torch.randn(64, 32), None, "int8", torch.float32)
    assert (int8.packed is not None) == fbgemm_matches_int_mm()
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX"):  # x86 with AVX-512 (VNNI here)
        assert int8.packed is not None


@pytest.mark.parametrize("passes", ["one", "two"])
def test_small_step_kernel_and_int_mm_give_bit_identical_rows(layer, passes):
    """Prefill-sized steps run torch._int_mm, small steps the GEMV kernel: a row must not notice which."""
    _, _, int8 = layer
    run = one_pass if passes == "one" else (lambda lin, x: lin(x))
    chunk = small_step_rows(int8) // (1 if passes == "one" else 2)
    x = torch.randn(3 * chunk, 256) * 4
    x[0] = x[0].abs()  # all-positive activations: the int16-saturation worst case for fbgemm
    big = run(int8, x)  # _int_mm
    for i in range(0, x.size(0), chunk):
        assert torch.equal(run(int8, x[i:i + chunk].clone()), big[i:i + chunk])


def test_one_pass_rows_match_exact_integer_arithmetic(layer):
    weight, bias, int8 = layer
    x = torch.randn(5, 256) * 3
    got = one_pass(int8, x).double()
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
    two_pass = int8(x)  # no RowSplit: every row is refined, like lm_head rows and generated tokens
    err = lambda y: ((y - weight_only).abs().max() / weight_only.abs().max()).item()  # noqa: E731
    assert err(two_pass) < 1e-3 < err(one_pass(int8, x))
    assert err(two_pass) * 50 < err(one_pass(int8, x))


def test_decode_row_is_bitwise_the_same_alone_or_batched(layer):
    _, _, int8 = layer
    x = torch.randn(8, 256)
    x[3] *= 50  # a row with a very different range must not change the others' scales
    batched = int8(x)  # 16 GEMM rows with the residual pass
    for i in range(8):
        assert torch.equal(int8(x[i:i + 1].clone())[0], batched[i])  # 2 rows: the small-step kernel


def test_every_row_count_of_the_fused_kernel_matches_int_mm(layer):
    """1 to MAX_ROWS / 2 generated rows (every split into register tiles, one K chunk or several) give the
    rows that torch._int_mm gives for a prefill-sized batch, bit for bit."""
    _, _, int8 = layer
    x = torch.randn(small_step_rows(int8), 256) * 2
    big = int8(x)  # twice the kernel's rows with the residual pass: torch._int_mm
    for n in range(1, small_step_rows(int8) // 2 + 1):
        assert torch.equal(int8(x[:n].clone()), big[:n]), n


def test_mixed_step_refines_only_generated_rows(layer):
    _, _, int8 = layer
    x = torch.randn(6, 256)
    rows = RowSplit.from_mask(torch.tensor([True, True, True, False, False, True]))
    mixed = int8(x, rows)
    assert torch.equal(mixed[rows.prompt], one_pass(int8, x[rows.prompt]))
    assert torch.equal(mixed[rows.decode], int8(x[rows.decode]))


def test_a_linear_without_the_residual_pass_gives_generated_rows_one_pass(layer, weights, monkeypatch):
    """Linear(residual=False) (model.RESIDUAL: the linears whose generated rows skip the pass): generated rows
    get exactly what prompt rows get, alone, batched, mixed with prompt rows, and past the fused kernel's rows."""
    weight, bias, int8 = layer
    backend = "native" if int8.native is not None else "fbgemm"
    lean = make_linear(weight, bias, backend, monkeypatch)
    lean.residual = False
    x = torch.randn(small_step_rows(int8), 256) * 3
    generated = RowSplit.from_mask(torch.zeros(x.size(0), dtype=torch.bool))
    want = one_pass(int8, x)
    assert torch.equal(lean(x, generated), want)  # as many rows as the fused kernel takes: one pass each
    assert not torch.equal(int8(x, generated), want)  # ... where the residual pass changes them
    for i in range(0, x.size(0), 3):
        assert torch.equal(lean(x[i:i + 3].clone(), RowSplit.from_mask(torch.zeros(3, dtype=torch.bool))), want[i:i + 3])
    mixed = RowSplit.from_mask(torch.tensor([True, False, True, False, False, True]))
    assert torch.equal(lean(x[:6], mixed), want[:6])
    assert torch.equal(lean(x[:6]), int8(x[:6]))  # without a RowSplit (lm_head rows) every row keeps the pass


def test_outlier_rows_keep_their_largest_channels_exact(layer):
    """Linear.outliers (the default refinement of generated rows on `down`): a refined row's m largest |x|
    are left out of its int8 pass and added through the int8 weights' columns in fp32, so a row whose
    range is set by a few outlier channels gets near the residual pass's accuracy with no extra GEMM row."""
    weight, bias, int8 = layer
    w8 = int8.weight.float() * (weight.abs().amax(dim=1, keepdim=True) / 127.0)  # the int8 weights, dequantized
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(5))
    x[:, [7, 66, 129]] *= 200  # three outlier channels at every k % 4
    x[:, 200] *= 30
    weight_only = x @ w8.t() + bias  # int8 weights with exact activations
    err = lambda y: ((y - weight_only).abs().max() / weight_only.abs().max()).item()  # noqa: E731
    residual = int8(x)
    int8.outliers = 4
    outliers = int8(x)  # every row refined (no RowSplit)
    assert err(outliers) < 3 * err(residual) and err(outliers) * 50 < err(one_pass(int8, x))
    sparse = torch.zeros(3, 256)  # nothing but outliers: the output is their exact fp32 sum
    sparse[0, [1, 2, 3, 4]] = torch.tensor([3.0, -2.0, 0.5, 7.0])
    sparse[1, [255, 128, 64]] = torch.tensor([-1.5, 2.5, 4.0])
    sparse[2, 10] = 1.0
    assert torch.allclose(int8(sparse), sparse @ w8.t() + bias, rtol=1e-6, atol=1e-6)


def test_outlier_rows_are_the_same_alone_batched_mixed_and_past_the_fused_kernel(layer):
    weight, bias, int8 = layer
    int8.outliers = 8
    n = small_step_rows(int8) + 6  # native: more rows than `linear` takes (quantize, torch._int_mm, finish)
    x = torch.randn(n, 256) * 2
    x[:, 5] *= 100
    x[1] = 1.0  # all ties: the lowest channels are the outliers
    x[2, :40] = -3.0
    generated = torch.rand(n, generator=torch.Generator().manual_seed(1)) < 0.6
    generated[:3] = True
    rows = RowSplit.from_mask(~generated)
    big = int8(x, rows)
    assert torch.equal(big[rows.prompt], one_pass(int8, x[rows.prompt]))
    for i in range(n):
        alone = RowSplit.from_mask(~generated[i:i + 1])
        assert torch.equal(int8(x[i:i + 1].clone(), alone), big[i:i + 1]), i
    torch_ops = Linear(weight, bias, "int8", torch.float32, outliers=8)  # the same arithmetic in PyTorch ops
    torch_ops.native = torch_ops.packed = torch_ops.exact = torch_ops.gemv = None
    want = torch_ops._int8(x[:4], torch.arange(4)) + bias
    assert torch.equal(int8(x[:4]), want)


def test_outliers_refine_only_linears_that_refine(layer, weights, monkeypatch):
    weight, bias, int8 = layer
    lean = make_linear(weight, bias, "native" if int8.native is not None else "fbgemm", monkeypatch)
    lean.residual, lean.outliers = False, 8
    x = torch.randn(5, 256)
    x[:, 3] *= 100
    generated = RowSplit.from_mask(torch.zeros(5, dtype=torch.bool))
    assert torch.equal(lean(x, generated), one_pass(int8, x))
    with pytest.raises(ValueError, match="0 to 32 channels"):
        Linear(weight, bias, "int8", torch.float32, outliers=33)


def test_a_transformer_refuses_residual_passes_on_linears_it_does_not_have():
    with pytest.raises(ValueError, match=r"\['mlp'\]: not linears of a layer \(qkv, o, gate_up, down\)"):
        model_module.Transformer(None, {}, quantize="int8", dtype=torch.float32, device="cpu", residual=("down", "mlp"))


def test_native_kernel_pads_odd_shapes(monkeypatch):
    torch.manual_seed(3)
    weight, bias = torch.randn(70, 30), torch.randn(70)  # neither a multiple of 64 outputs nor of 4 inputs
    int8 = make_linear(weight, bias, "native", monkeypatch)
    x = torch.randn(3, 30)
    assert torch.equal(int8(x), torch.cat([int8(x[i:i + 1]) for i in range(3)]))
    want = _reference(x, weight, bias, int8)
    assert ((one_pass(int8, x).double() - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize("shape,with_bias,rows", [((5003, 96), False, 12), ((333, 30), True, 12), ((5003, 96), False, 17)])
def test_screened_greedy_head_has_the_full_heads_argmax_and_exact_logits(shape, with_bias, rows, monkeypatch):
    """The greedy lm_head (csrc/lm_head.cpp) reads a 4-bit screen and rescores its candidates exactly:
    every row's argmax and every finite logit must be the full int8 layer's, for more rows than one
    kernel call takes and for shapes that need padding."""
    torch.manual_seed(5)
    weight = torch.randn(*shape) * 0.05
    int8 = make_linear(weight, torch.randn(shape[0]) * 0.01 if with_bias else None, "native", monkeypatch)
    int8.prepare_greedy()
    winners = [7, 99, shape[0] - 1, 0, 123]
    x = torch.randn(rows, shape[1])
    x[:5] = weight[winners] * 40  # peaked rows: one token clearly wins, as in most decode steps
    full = int8(x)
    got = int8.greedy_logits(x, torch.ones(rows, dtype=torch.bool))
    finite = torch.isfinite(got)
    assert torch.equal(got.argmax(1), full.argmax(1))
    assert got.argmax(1)[:5].tolist() == winners
    assert torch.equal(got[finite], full[finite])
    assert (finite.sum(1) >= 1).all() and (finite[:5].sum(1) < shape[0] // 10).all()  # it screens
    assert int8.screened_rows == rows and int8.screened_candidates == int(finite.sum())


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_screened_greedy_head_keeps_exactly_the_tokens_its_rule_keeps(rows, monkeypatch):
    """The candidates are the tokens whose upper bound reaches the row's largest lower bound (lm_head.cpp's
    design note), however the vocabulary is split over threads and register tiles: computed here in float64
    from the int8 weights, they must be the kernel's finite logits (bar a token within rounding of the floor)."""
    torch.manual_seed(8)
    weight = torch.randn(20000, 64) * 0.05
    int8 = make_linear(weight, None, "native", monkeypatch)
    int8.prepare_greedy()
    x = torch.randn(rows, 64)
    x[rows - 1] = weight[1234] * 40  # a peaked row (the only one when rows == 1) keeps few tokens
    before = native.int8_kernels().threads()
    native.int8_kernels().set_threads(2)  # the vocabulary in several chunks, merged
    try:
        got = int8.greedy_logits(x, torch.ones(rows, dtype=torch.bool))
    finally:
        native.int8_kernels().set_threads(before)
    w = int8.weight.to(torch.int64)
    h, low = w >> 4, (w & 15).double()
    scale = (x.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127).double()
    q = torch.round(x.double() / scale)
    ws = int8.scale.double()
    est = (16 * (q @ h.double().T) + low.mean(1) * q.sum(1, keepdim=True)) * ws
    spread = 8.0 * q.norm(dim=1, keepdim=True) * low.std(1, unbiased=False) * ws
    floor = (est - spread).amax(1, keepdim=True)
    upper = est + spread
    want, near = upper >= floor, (upper - floor).abs() <= 1e-5 * floor.abs()
    assert want.sum() >= rows and (rows == 1 or want.sum() > 2 * rows)  # random rows keep several tokens
    assert torch.equal(torch.isfinite(got) | near, want | near)


def test_screened_greedy_head_leaves_sampled_rows_to_the_full_layer(monkeypatch):
    torch.manual_seed(6)
    weight = torch.randn(700, 64) * 0.05
    int8 = make_linear(weight, None, "native", monkeypatch)
    int8.prepare_greedy()
    x = torch.randn(4, 64)
    greedy = torch.tensor([True, False, True, False])
    got, full = int8.greedy_logits(x, greedy), int8(x)
    assert torch.equal(got[~greedy], full[~greedy]) and torch.isfinite(got[~greedy]).all()
    assert torch.equal(got[greedy].argmax(1), full[greedy].argmax(1))
    assert not torch.isfinite(got[greedy]).all()


def test_greedy_head_without_the_native_kernel_is_the_full_layer(weights, monkeypatch):
    weight, bias = weights
    int8 = make_linear(weight, bias, "fbgemm", monkeypatch)
    int8.prepare_greedy()
    x = torch.randn(3, 256)
    assert int8.screen is None and torch.equal(int8.greedy_logits(x, torch.ones(3, dtype=torch.bool)), int8(x))


def test_mixed_step_without_fbgemm_computes_prompt_and_decode_rows_with_their_own_kernels(weights, monkeypatch):
    weight, bias = weights
    monkeypatch.setattr(int8_module, "int8_kernels", lambda: None)
    int8 = Linear(weight, bias, "int8", torch.float32)
    int8.packed = int8.gemv = None  # what a build without fbgemm or AVX2 gets: weight-only kernel for generated tokens
    x = torch.randn(6, 256)
    rows = RowSplit.from_mask(torch.tensor([True, True, True, False, False, True]))
    mixed = int8(x, rows)
    assert torch.equal(mixed[rows.prompt], one_pass(int8, x[rows.prompt]))
    assert torch.equal(mixed[rows.decode], int8(x[rows.decode]))


def test_fallback_kernel_without_fbgemm(layer, monkeypatch):
    weight, bias, int8 = layer
    monkeypatch.setattr(int8_module, "int8_kernels", lambda: None)
    fallback = Linear(weight, bias, "int8", torch.float32)
    fallback.packed = fallback.gemv = None  # what a build without fbgemm or AVX2 gets
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


@pytest.fixture(scope="module")
def ops():
    if native.unavailable_reason() is not None:
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    ext = native.int8_kernels()
    need(ext is not None, "the native kernels (build failed)", "install g++ and ninja (make test does)")
    return ext


def _reference_attention(q, k, v, n):
    """float64 causal attention of the last n positions of a context: q (n, H, hd), k/v (ctx, KVH, hd)."""
    heads, kv_heads, ctx = q.size(1), k.size(1), k.size(0)
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), k)
    visible = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads,kv_heads,hd,longest", [(6, 2, 32, 20), (12, 1, 64, 90), (12, 2, 128, 40), (7, 1, 64, 33),
                                                     (14, 2, 64, 300), (4, 1, 48, 257)])
def test_native_attention_matches_causal_softmax_over_scattered_slots(ops, heads, kv_heads, hd, longest):
    """Sequences up to 300 keys: several of attend's key segments (layer_ops.cpp), merged."""
    torch.manual_seed(5)
    cache = 512
    kc, vc = torch.randn(cache, kv_heads, hd), torch.randn(cache, kv_heads, hd)
    seqs = [(torch.randperm(cache)[:longest], 1), (torch.randperm(cache)[:9], 4), (torch.randperm(cache)[:3], 3)]
    q = torch.randn(sum(n for _, n in seqs), heads, hd)
    kv_off = torch.tensor([0] + [len(s) for s, _ in seqs]).cumsum(0)
    q_off = torch.tensor([0] + [n for _, n in seqs]).cumsum(0)
    out = ops.attend(q, kc, vc, torch.cat([s for s, _ in seqs]), kv_off, q_off)
    for b, (slots, n) in enumerate(seqs):
        rows = slice(int(q_off[b]), int(q_off[b + 1]))
        want = _reference_attention(q[rows], kc[slots], vc[slots], n)
        assert (out[rows].double() - want).abs().max() < 1e-5
        alone = ops.attend(q[rows].clone(), kc, vc, slots, torch.tensor([0, len(slots)]), torch.tensor([0, n]))
        assert torch.equal(alone, out[rows])  # a sequence's rows do not depend on the rest of the step


@pytest.mark.parametrize("ctx,n", [(40, 5), (300, 8), (130, 4)])
def test_native_attention_gives_a_query_row_the_same_bits_alone_or_with_its_sequences_other_rows(ops, ctx, n):
    """A verify step of speculation attends n query rows of one sequence at once; each row must get exactly what
    plain decoding gives it one step at a time (the same context, alone), or speculation changes the answer."""
    torch.manual_seed(9)
    kc, vc = torch.randn(512, 2, 64), torch.randn(512, 2, 64)
    slots = torch.randperm(512)[:ctx]
    q = torch.randn(n, 14, 64)
    together = ops.attend(q, kc, vc, slots, torch.tensor([0, ctx]), torch.tensor([0, n]))
    for j in range(n):
        seen = ctx - n + j + 1
        alone = ops.attend(q[j:j + 1].clone(), kc, vc, slots[:seen], torch.tensor([0, seen]), torch.tensor([0, 1]))
        assert torch.equal(alone[0], together[j])


def test_native_rope_store_matches_apply_rope_and_the_cache_write(ops):
    torch.manual_seed(6)
    heads, kv_heads, hd, tokens = 4, 2, 16, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * hd)
    angles = torch.randn(tokens, hd // 2)
    cos = torch.cat([angles, angles], -1).cos()
    sin = torch.cat([angles, angles], -1).sin() * torch.cat([-torch.ones(hd // 2), torch.ones(hd // 2)])
    kc, vc = torch.zeros(10, kv_heads, hd), torch.zeros(10, kv_heads, hd)
    slots = torch.tensor([7, 2, 5])
    q = ops.rope_store(qkv, cos, sin, heads, kv_heads, 0.25, kc, vc, slots)
    x = qkv.view(tokens, heads + 2 * kv_heads, hd)
    rotated = apply_rope(x[:, :heads + kv_heads], cos[:, None], sin[:, None])
    assert torch.allclose(q, rotated[:, :heads] * 0.25, atol=1e-6)
    assert torch.allclose(kc[slots], rotated[:, heads:], atol=1e-6)
    assert torch.equal(vc[slots], x[:, heads + kv_heads:])
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[slots] = False
    assert not kc[untouched].any() and not vc[untouched].any()


def test_native_rms_norm_matches_pytorch(ops):
    torch.manual_seed(7)
    x, w = torch.randn(5, 96) * 3, torch.rand(96)
    assert torch.allclose(ops.rms_norm(x, w, 1e-6), model_module.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)


def test_native_swiglu_matches_silu_times_up(ops):
    torch.manual_seed(8)
    gate_up = torch.randn(3, 2 * 37) * 8  # 37: not a multiple of the 16-wide vectors
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -87.5])
    gate, up = gate_up.chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate.double()) * up.double())
    assert torch.allclose(ops.swiglu(gate_up).double(), want, rtol=1e-6, atol=1e-30)


def test_native_exp_scales_by_two_to_the_128th_without_overflow(ops):
    """exp16 clamps its input at 88.7 and scales its polynomial by 2^n, n up to 128 there: vscalefps gives a finite
    p * 2^128 (p < 1). The AVX2 build's emulation of it once computed 2^128 alone, overflowed to inf, and gave
    silu(-100) = -0 where the AVX-512 build gives -100 / (1 + e^88.7)."""
    out = float(ops.swiglu(torch.tensor([[-100.0, -88.5, 1.0, 1.0]]))[0, 0])
    want = -100.0 / (1.0 + math.exp(88.7))
    assert out < 0 and abs(out - want) <= 1e-5 * abs(want)
    edge = float(ops.swiglu(torch.tensor([[-88.5, 1.0]]))[0, 0])  # n = 128 without the clamp: e^88.5
    assert edge < 0 and abs(edge + 88.5 / (1.0 + math.exp(88.5))) <= 1e-5 * 88.5 / (1.0 + math.exp(88.5))


def test_exact_int_mm_is_int_mm_bit_for_bit_past_the_fp32_integer_range():
    """Sums beyond 2**24 (K = 2,600 of 127 * 127) must come out exact, as torch._int_mm's int32 does."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randint(-127, 128, (70, 2600), generator=gen, dtype=torch.int8)
    x = torch.randint(-127, 128, (9, 2600), generator=gen, dtype=torch.int8)
    weight[0], x[0] = 127, 127  # 127 * 127 * 2600 = 41.9M: not exact as one fp32 sum
    got = int8_module.exact_int_mm(x.float(), int8_module.exact_slices(weight))
    assert got.dtype == torch.int32 and torch.equal(got, torch._int_mm(x, weight.t()))
    assert got[0, 0].item() == 127 * 127 * 2600


def without_vnni(monkeypatch, avx2=None, int_mm_fast: bool = False) -> None:
    """What `Linear` finds on a CPU without AVX-512 VNNI and an exact fbgemm: the AVX2 kernel (or none), and
    an `_int_mm` that is fast (AVX-VNNI) or not."""
    monkeypatch.setattr(int8_module, "int8_kernels", lambda: None)
    monkeypatch.setattr(int8_module, "avx2_kernels", lambda: avx2)
    monkeypatch.setattr(int8_module, "fbgemm_matches_int_mm", lambda: False)
    monkeypatch.setattr(int8_module, "int_mm_is_fast", lambda: int_mm_fast)


def test_prompt_rows_without_vnni_go_through_the_exact_gemm_and_match_int_mm(weights, monkeypatch):
    weight, bias = weights
    without_vnni(monkeypatch)
    exact = Linear(weight, bias, "int8", torch.float32)
    monkeypatch.setattr(int8_module, "int_mm_is_fast", lambda: True)
    int_mm = Linear(weight, bias, "int8", torch.float32)
    assert exact.exact is not None and int_mm.exact is None
    x = torch.randn(40, 256)
    rows = RowSplit.from_mask(torch.ones(40, dtype=torch.bool))
    assert torch.equal(exact(x, rows), int_mm(x, rows))


def test_a_build_killed_midway_does_not_block_the_next_one(tmp_path, monkeypatch):
    """torch's `lock` baton outlives a killed build; the next builder must clear it, not wait forever."""
    import fcntl

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = native.build_dir()
    out.mkdir(parents=True)
    (out / "lock").touch()  # what a killed build leaves
    seen = {}

    def fake_load(name, sources, extra_cflags, build_directory, verbose):
        seen["dir"], seen["baton_left"] = build_directory, (out / "lock").exists()
        with open(out / "build.flock") as other:  # the builders' flock is held while torch builds
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert native.build() == "module"
    assert seen == {"dir": str(out), "baton_left": False}


def test_a_live_builder_is_waited_for_then_given_up_on(tmp_path):
    import fcntl

    with open(tmp_path / "build.flock", "w") as holder, open(tmp_path / "build.flock", "w") as guard:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match="delete"):
            native._hold(guard, tmp_path, wait_s=0.6)
        fcntl.flock(holder, fcntl.LOCK_UN)
        native._hold(guard, tmp_path, wait_s=0.6)  # free now: taken at once


def test_the_build_directory_follows_the_sources(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = native.build_dir()
    monkeypatch.setattr(native, "CFLAGS", [*native.CFLAGS, "-DCHANGED"])
    assert native.build_dir() != first and native.build_dir().parent == first.parent


def test_bfloat16_kv_cache_holds_rounded_keys_and_attends_over_them_exactly(ops):
    """engine.kv_dtype = "bfloat16": rope_store writes what torch's .to(bfloat16) gives (round half to
    even, ties included), the queries are unchanged, and attention over the bf16 cache is attention over
    its values widened to float32, bit for bit."""
    torch.manual_seed(7)
    heads, kv_heads, hd, n = 6, 2, 64, 5
    qkv = torch.randn(n, (heads + 2 * kv_heads) * hd)
    v_start = (heads + kv_heads) * hd
    qkv[0, v_start:v_start + 4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -130])  # ties, subnormal
    cos, sin = torch.randn(n, hd), torch.randn(n, hd)
    slots = torch.tensor([3, 0, 7, 9, 4])
    k32, v32 = torch.zeros(12, kv_heads, hd), torch.zeros(12, kv_heads, hd)
    k16, v16 = torch.zeros(12, kv_heads, hd, dtype=torch.bfloat16), torch.zeros(12, kv_heads, hd, dtype=torch.bfloat16)
    q32 = ops.rope_store(qkv, cos, sin, heads, kv_heads, 0.125, k32, v32, slots)
    q16 = ops.rope_store(qkv, cos, sin, heads, kv_heads, 0.125, k16, v16, slots)
    assert torch.equal(q32, q16)
    assert torch.equal(k16, k32.to(torch.bfloat16)) and torch.equal(v16, v32.to(torch.bfloat16))
    assert v16[3, 0, :2].float().tolist() == [1.0, 1 + 2 ** -6]
    q = torch.randn(2, heads, hd)
    kv_off, q_off = torch.tensor([0, 5]), torch.tensor([0, 2])
    got = ops.attend(q, k16, v16, slots, kv_off, q_off)
    assert torch.equal(got, ops.attend(q, k16.float(), v16.float(), slots, kv_off, q_off))
    assert (got - ops.attend(q, k32, v32, slots, kv_off, q_off)).abs().max() < 0.05  # and close to float32 KV


def test_native_argmax_is_torchs_argmax():
    """model.argmax (csrc/lm_head.cpp `argmax_rows`) picks each row's token exactly as torch.argmax does: the
    first of tied maxima, a lone finite logit among -inf (the screened head's rows), the first NaN, odd lengths."""
    need(native.unavailable_reason() is not None or native.int8_kernels() is not None,
         "the native int8 kernel (build failed)", "install g++ and ninja (make test does)")
    if native.unavailable_reason() is not None:
        pytest.skip(f"native kernel: {native.unavailable_reason()}")
    ops = native.int8_kernels()
    gen = torch.Generator().manual_seed(7)
    for width in (1, 15, 16, 17, 151_936):
        rows = torch.randn(9, width, generator=gen)
        rows[1] = float("-inf")  # nothing finite: torch names index 0
        rows[2] = float("-inf")
        rows[2, width - 1] = -3.0  # one candidate, last
        rows[3] = 1.0  # all tied
        rows[4, width // 2:] = rows[4].max() + 1  # tied maxima in several lanes: the first wins
        rows[5, width // 3] = float("nan")
        rows[6] = rows[6].round()  # many ties among integers
        assert ops.argmax_rows(rows).tolist() == rows.argmax(-1).tolist(), width
        assert model_module.argmax(rows) == rows.argmax(-1).tolist()  # what the engine and the draft model call
    sliced = torch.randn(4, 40, generator=gen)[:, 3:37]  # not contiguous
    assert ops.argmax_rows(sliced).tolist() == sliced.argmax(-1).tolist()


def _every_kernel(ops, seed: int) -> list:
    """One call of every threaded kernel on shapes that split into many chunks (csrc/pool.h)."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(1000, 200, generator=g) * 0.05)
    q8 = (weight / (weight.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8)
    scale = weight.abs().amax(1) / 127
    packed = ops.pack(q8)
    x = torch.randn(12, 200, generator=g)
    refine = torch.tensor([True, False] * 6)
    head = ops.head_pack(q8)
    kc, vc = torch.randn(96, 2, 64, generator=g), torch.randn(96, 2, 64, generator=g)
    q = torch.randn(10, 6, 64, generator=g)
    slots = torch.randperm(96, generator=g)[:40]
    return [
        ops.linear(x, packed, scale, None, refine, 0),
        ops.linear(x[:5], packed, scale, None, refine[:5], 4),
        *ops.quantize(x, refine, 0),
        *ops.head_greedy(x[:8], *head, q8, scale, None, 8.0),
        ops.argmax_rows(torch.randn(9, 5000, generator=g)),
        ops.rms_norm(x, torch.randn(200, generator=g), 1e-6),
        ops.swiglu(torch.randn(12, 400, generator=g)),
        ops.attend(q, kc, vc, slots, torch.tensor([0, 25, 40]), torch.tensor([0, 7, 10])),
    ]


def test_threaded_kernels_give_the_same_bits_on_any_number_of_threads_and_callers(ops):
    """The kernels split their work over their own pool (csrc/pool.h): the split, a pool larger than the
    machine, and two callers at once (the second runs alone) must never change a bit of any result."""
    import threading

    before = ops.threads()
    try:
        ops.set_threads(1)
        assert ops.threads() == 1
        want = [_every_kernel(ops, seed) for seed in range(3)]
        for n in (2, 3, 5):
            ops.set_threads(n)
            assert ops.threads() == n
            for seed in range(3):
                assert all(torch.equal(a, b) for a, b in zip(_every_kernel(ops, seed), want[seed])), (n, seed)
        got: dict[int, list] = {}

        def caller(seed: int) -> None:
            got[seed] = [_every_kernel(ops, seed) for _ in range(20)][-1]

        threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(torch.equal(a, b) for seed in range(3) for a, b in zip(got[seed], want[seed]))
    finally:
        ops.set_threads(before)


def test_a_forked_child_runs_the_threaded_kernels_alone(ops):
    import os
    import time

    before = ops.threads()
    try:
        ops.set_threads(3)
        want = _every_kernel(ops, 1)
        pid = os.fork()
        if pid == 0:  # the child: the pool's workers did not come along
            try:
                torch.set_num_threads(1)  # torch's own OpenMP team did not either (libgomp hangs on it)
                same = all(torch.equal(a, b) for a, b in zip(_every_kernel(ops, 1), want))
                os._exit(0 if same and ops.threads() == 1 else 1)
            finally:
                os._exit(2)
        deadline = time.monotonic() + 120
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the forked child hung or failed"
        assert all(torch.equal(a, b) for a, b in zip(_every_kernel(ops, 1), want))  # the parent's pool still works
    finally:
        ops.set_threads(before)


def test_the_engine_thread_count_reaches_the_kernels(ops):
    """engine.num_threads = N gives torch and the kernels N threads; 0 gives the kernels one per core."""
    import os

    from assistant.engine.loading import physical_cores, set_threads

    before, kernels = torch.get_num_threads(), ops.threads()
    try:
        assert set_threads(3) == 3 and torch.get_num_threads() == 3 and ops.threads() == 3
        assert set_threads(1) == 1 and ops.threads() == 1
        assert set_threads(0) == max(1, (os.cpu_count() or 2) // 2) and ops.threads() == physical_cores()
        assert 1 <= physical_cores() <= (os.cpu_count() or 1)
    finally:
        torch.set_num_threads(before)
        ops.set_threads(kernels)


@pytest.mark.parametrize("shape", [(300, 256), (70, 30), (129, 1)])
def test_native_weight_quantization_is_the_torch_ops_to_the_bit(shape, monkeypatch):
    """`quantize_pack` (one parallel pass, the engine build's) gives the scales, int8 weights and packed bytes of
    the torch ops and `pack` it replaced, ties rounding to even and an all-zero row included."""
    torch.manual_seed(5)
    weight = torch.randn(*shape) * 0.05
    weight[0] = 0.0  # scale from the 1e-8 floor
    if shape[1] >= 8:
        weight[1, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5])  # scale 1: every value a tie
    lin = make_linear(weight, None, "native", monkeypatch)
    scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    assert torch.equal(lin.scale, scale) and torch.equal(lin.weight, q)
    assert torch.equal(lin.vnni, lin.native.pack(q))
    if shape[1] >= 8:
        assert lin.weight[1, :8].tolist() == [127, 2, -4, 0, 0, 2, 126, -126]
    cut = [shape[0] // 3, shape[0] // 3 + 1]  # parts stacked along the outputs (a fused q/k/v) give the same
    parts = Linear([weight[:cut[0]], weight[cut[0]:cut[1]], weight[cut[1]:]], None, "int8", torch.float32)
    assert torch.equal(parts.scale, scale) and torch.equal(parts.weight, q) and torch.equal(parts.vnni, lin.vnni)


@pytest.fixture(scope="module")
def avx2():
    """The AVX2 int8 GEMM (csrc/avx2_gemv.cpp), built wherever the CPU has AVX2, AVX-512 or not."""
    if native.unavailable_reason(native.AVX2_FLAGS) is not None:
        pytest.skip(f"AVX2 kernel: {native.unavailable_reason(native.AVX2_FLAGS)}")
    try:
        return native.build(native.AVX2_SOURCES, "assistant_engine_avx2", native.AVX2_CFLAGS)
    except Exception as exc:  # noqa: BLE001
        need(False, f"the AVX2 int8 kernel (build failed: {exc})", "install g++ and ninja (make test does)")


@pytest.mark.parametrize("n,k,r", [(300, 256, 1), (301, 262, 3), (64, 896, 4), (17, 1024, 9), (1000, 4864, 16),
                                   (40, 512, 130)])
def test_avx2_gemm_is_int_mm_bit_for_bit(avx2, n, k, r):
    gen = torch.Generator().manual_seed(n + k + r)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    x = torch.randint(-127, 128, (r, k), generator=gen, dtype=torch.int8)
    w[0], x[0] = 127, 127  # the largest pair sums: 2 * 127 * 127 per int16 lane, no saturation
    w[-1], x[-1] = -127, -127
    assert torch.equal(avx2.gemv(x, avx2.gemv_pack(w), n), (x.long() @ w.long().t()).int())


def test_without_vnni_decode_rows_take_the_prompt_rows_arithmetic(avx2, weights, monkeypatch):
    """On an AVX2 CPU a generated row is quantized like every other row (int8 activations, the residual
    pass), and its output is the same bits whether the AVX2 kernel or the prompt path (`exact_int_mm`)
    computes it, alone or in a batch: one arithmetic, whatever the batch."""
    weight, bias = weights
    without_vnni(monkeypatch, avx2)
    lin = Linear(weight, bias, "int8", torch.float32)
    assert lin.gemv is not None and lin.packed is None and lin.native is None and lin.exact is None  # no fp32 copy
    reference = Linear(weight, bias, "int8", torch.float32)
    reference.gemv, reference.exact = None, int8_module.exact_slices(reference.weight)
    x = torch.randn(20, 256) * 3
    generated = RowSplit.from_mask(torch.zeros(20, dtype=torch.bool))  # every row a generated token
    batched = lin(x, generated)  # 40 GEMM rows
    want = reference._int8(x, slice(None)) + bias  # exact_int_mm's
    assert torch.equal(batched, want)
    for i in range(0, 20, 7):  # 2 GEMM rows
        alone = lin(x[i:i + 1].clone(), RowSplit.from_mask(torch.zeros(1, dtype=torch.bool)))
        assert torch.equal(alone, batched[i:i + 1]), i
    assert torch.equal(lin(x[:2]), want[:2])  # the lm_head's rows (no split): refined as well
    prompt = RowSplit.from_mask(torch.ones(20, dtype=torch.bool))  # a prompt chunk: one pass, the same kernel
    assert torch.equal(lin(x, prompt), reference._int8(x, None) + bias)
    without_vnni(monkeypatch, avx2, int_mm_fast=True)  # AVX-VNNI: past GEMV_MAX_ROWS rows, oneDNN's `_int_mm`
    vnni = Linear(weight, bias, "int8", torch.float32)
    assert vnni.gemv is not None and vnni.exact is None
    assert torch.equal(vnni(x, generated), batched) and torch.equal(vnni(x[:1], RowSplit.from_mask(
        torch.zeros(1, dtype=torch.bool))), batched[:1])


def test_outlier_channels_are_a_stable_sorts_first_m_ties_to_the_lower_index():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(6, 4864, generator=gen).abs()
    a[1, 100:140] = 9.0  # 40 ties at the top: the 16 lowest indices win
    a[2, [7, 3000, 11]] = 5.0  # ties at the m-th place
    a[2, :7] = 6.0
    a[3, 5] = float("inf")
    a[4, 9] = float("nan")  # never chosen
    a[5] = 0.0  # all tied
    want = a.nan_to_num(nan=-1.0).sort(dim=1, descending=True, stable=True).indices[:, :16].sort(dim=1).values
    got = int8_module.largest(a, 16)
    assert torch.equal(got, want)
    assert got[1].tolist() == list(range(100, 116)) and got[5].tolist() == list(range(16)) and 9 not in got[4]
    assert torch.equal(int8_module.largest(a[:, :8], 16), torch.arange(8).expand(6, 8))  # m past K: every channel


@pytest.fixture(scope="module")
def avx2_build():
    """The native kernels' AVX2 build (csrc/avx512_on_avx2.h): the engine's own kernels on an AVX2 CPU, and built
    beside the AVX-512 ones on an AVX-512 CPU, so that the two can be compared."""
    if native.target() == "avx2":
        ext = native.int8_kernels()
        need(ext is not None, "the native kernels' AVX2 build (build failed)", "install g++, ninja and libsimde-dev")
        return ext
    if native.unavailable_reason(native.EMULATED_FLAGS) is not None or native.simde_include() is None:
        pytest.skip("the AVX2 build needs AVX2, FMA and SIMDe's headers (libsimde-dev)")
    try:
        return native.build(native.SOURCES, "assistant_engine_native_avx2", native.emulated_cflags())
    except Exception as exc:  # noqa: BLE001
        need(False, f"the native kernels' AVX2 build (build failed: {exc})", "install g++, ninja and libsimde-dev")


@pytest.mark.parametrize("n,k,r", [(300, 256, 1), (301, 262, 7), (64, 896, 33), (1000, 4864, 40), (70, 200, 130)])
def test_avx2_build_int_mm_is_int_mm_bit_for_bit(avx2_build, n, k, r):
    """Prompt chunks past the kernel's rows, on the AVX2 build: its own GEMM over `pack`'s layout, not oneDNN's."""
    gen = torch.Generator().manual_seed(n * k + r)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    x = torch.randint(-127, 128, (r, k), generator=gen, dtype=torch.int8)
    w[0], x[0], w[-1], x[-1] = 127, 127, -127, -127
    assert torch.equal(avx2_build.int_mm(x, avx2_build.pack(w), n), (x.long() @ w.long().t()).int())


@pytest.mark.parametrize("n,k,r,outliers", [(1000, 200, 40, 0), (1000, 200, 40, 4), (77, 896, 35, 0), (300, 4864, 33, 2)])
def test_avx2_build_int_mm_finish_is_finish_of_int_mm(avx2_build, n, k, r, outliers):
    """Prompt chunks on the AVX2 build apply the epilogue strip by strip: the same bits as `finish` over the whole
    int32 product, with residual rows or outlier channels, a bias, and outputs not a multiple of 16."""
    gen = torch.Generator().manual_seed(n + k + r + outliers)
    weight = torch.randn(n, k, generator=gen) * 0.05
    scale = weight.abs().amax(1) / 127
    q8 = (weight / scale[:, None]).round().to(torch.int8)
    packed, bias = avx2_build.pack(q8), torch.randn(n, generator=gen)
    x = torch.randn(r, k, generator=gen)
    x[3, 5] = 40.0  # an outlier channel
    refine = torch.rand(r, generator=gen) < 0.5
    for b in (None, bias):
        q = avx2_build.quantize(x, refine, outliers)
        extra = (q[2], q[3]) if outliers else (None, None)
        want = avx2_build.finish(avx2_build.int_mm(q[0], packed, n), scale, q[1], refine, b,
                                 packed if outliers else None, *extra)
        got = avx2_build.int_mm_finish(q[0], packed, scale, q[1], refine, b, *extra)
        assert torch.equal(got, want)


def test_avx2_build_gives_the_avx512_builds_bits(ops, avx2_build):
    """Where both builds run (an AVX-512 CPU), every kernel gives the same bits: an AVX2 machine answers as an
    AVX-512 one does (the emulation is lane for lane the same IEEE operation, reductions in GCC's order)."""
    if native.target() != "avx512":
        pytest.skip("needs an AVX-512 CPU, to run both builds")
    for seed in (0, 1):
        for a, b in zip(_every_kernel(ops, seed), _every_kernel(avx2_build, seed)):
            assert torch.equal(a, b)
