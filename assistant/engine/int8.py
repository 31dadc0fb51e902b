"""The engine's linear layer, `Linear`: y = x @ W.T + b, with W kept as fp32/bf16, or with
`quantize="int8"` as per-channel int8 + scales and run by one of the kernels below. model.py builds
every linear of the transformer (and its lm_head) from it and hands each call the step's `RowSplit`
(which rows are prompt tokens and which generated ones: the two are quantized differently).

int8 (`quantize="int8"`): per-output-channel symmetric int8 weights and dynamic per-row symmetric
int8 activations, so every output is an exact int32 dot product, converted to float and scaled by
the weight's channel scale, then by the row's scale.
Generated tokens get a second pass on the linears that need it (`residual=True`; model.RESIDUAL, set
by `engine.int8_residual`): their quantization residual (x - scale * q, at most half a step) is
quantized at 1/254 of the step and goes into the same GEMM as an extra row, so the activations keep
~15 bits while the weights are read once. Measured against fp32 on the bench's 8 prompts, 48 tokens
each, teacher-forced through decode steps (next-token top-1 agreement, greedy answers identical): one
pass 0.954 (1/8); with the residual pass 0.980-0.989 (4-5/8); bf16 activations with
`_weight_int8pack_mm` 0.974 (4/8). Which linears need it, measured on 24 prompts (794 decode rows,
top-1 agreement with fp32 / mean KL(fp32 || int8) of the next-token distribution): every linear 0.975
/ 0.0032; all but gate_up 0.975 / 0.0036; **down only 0.977 / 0.0039**; qkv and down 0.974 / 0.0038; none
0.966 / 0.0063. Those prompts chose `down`; on 24 other prompts held back until then (773 rows): every
linear 0.973 / 0.0030, down only 0.972 / 0.0037, none 0.959 / 0.0064. The pass pays off on `down`, whose input (SwiGLU's output) has the outlier channels
that set a row's scale; elsewhere it buys little. A pass costs nothing in a 1-row step (bound by the
weight bytes) but a GEMM row in a step of several rows (bound by multiply-adds, below), and gate_up
alone is 58% of a layer's multiply-adds: with `down` only, a generated row is 1.29 GEMM rows instead
of 2, and an 8-row step 1.95x a 1-row step instead of 2.13x (its step curve, two models in one run).
Tried instead of the pass on `down`, same 24 prompts: SmoothQuant-style channel factors (calibrated on
1,024 tokens of other text, folded into up_proj's rows and down_proj's columns) with no pass: 0.958 /
0.0084 at alpha 0.5, worse than no pass at all (down's weights then lose what its activations gain);
on every linear 0.972 / 0.0066.
**Outlier channels instead of the residual pass** (`outliers`, `engine.int8_outliers`, default 16 on the
refining linears): a generated row's m largest |x| are left out of its int8 pass, so the rest is quantized at
the finer step they leave, and are added back in fp32 through the int8 weights' columns (read from the packed
block the GEMM has just streamed: csrc/int8_common.h), as LLM.int8() does. No extra GEMM row, so a generated row
costs 1 GEMM row, not 1.29. Same 24 prompts (794 rows), residual pass on `down` 0.977 / 0.00385; outliers on
`down` m = 4: 0.975 / 0.00431, **m = 8: 0.979 / 0.00398, m = 16: 0.972 / 0.00391**, m = 32: 0.969 / 0.00386 (KL
falls with m; top-1 moves by a few rows either way). On every linear (m = 8: 0.975 / 0.00352, m = 16: 0.975 /
0.00333) it is more accurate still. Held-back check (the other 24 prompts, 773 rows, run once after the
choice): residual pass on `down` 0.972 / 0.0037, 16 outliers on `down` 0.968 / 0.0039 (8: 0.969 / 0.0039), one
pass 0.959 / 0.0064: the outliers keep ~92% of what the residual pass buys. On every linear the fp32
column sums would cost ~3 ms of an 8-row step (gate_up's 9,728 outputs), so only `down` refines.
Decode only, same run, alternating engines: 8 streams 4.41-4.50x one stream's with the residual pass,
4.92-4.99x with 16 outliers; 8-row step 1.91x -> 1.73x a 1-row step.
(Single answers are no measure: `assistant chat` answers "What is 2+2?" with 4 or 6 depending on
rounding details, and fp32 itself only repeats the question.) Prompt tokens keep one pass: prefill is
compute-bound, and only a prompt's last token is sampled (its lm_head row gets the pass).
Kernels, all computing exactly that arithmetic, so a row's output never depends on which one ran:
  * native.py (default where the CPU has AVX-512 VNNI and g++ is present): up to MAX_ROWS (32) GEMM
    rows (decode steps of up to 16 sequences or speculated tokens, small chunks) go through one fused
    call (row quantization, residual rows, a VNNI GEMM that streams each weight byte from memory once
    for all rows, epilogue; csrc/int8_linear.cpp has the design note); more rows through the same
    kernel-side quantization and epilogue around `torch._int_mm` (oneDNN), which costs about twice as much
    per row here, so prompts go in steps of MAX_ROWS tokens (model.py `step_rows`). On a CPU with AVX2 and FMA
    but no AVX-512 the same kernels run as native.py's AVX2 build: past MAX_ROWS rows its own exact
    `int_mm_finish` (the GEMM and the epilogue, strip by strip) replaces oneDNN's, which has no VNNI path
    there, and its prompts go in the scheduler's chunks. Decode step, Qwen2.5-0.5B, 2 threads, same run:
    47 ms against 68-90 ms through the PyTorch ops below (native.py says where
    that time went). Past a few rows a step is bound by multiply-adds, not bytes: the machine does
    ~2.5-2.8e9 `vpdpbusd` a second (both vCPUs together, the kernels then on one thread), ~2.2 ms of them
    per GEMM row of this model, so 8 rows refined on every linear (16 GEMM rows) could not cost less than
    ~36 ms of int8 work whatever the layout; refined on `down` only they are ~10.3 GEMM rows. (On the Zen 5
    machine of 2026-11-30 a register-only loop does 8.4e9 a second per core: README, Benchmarks.)
    The prefill-chunk tuner in local.py measures what a step with prompt tokens costs and sizes
    chunks for its inter-token target.
  * without them (no AVX2 build either: no FMA, no SIMDe headers), up to FBGEMM_MAX_ROWS rows: fbgemm's prepacked int8 GEMM
    (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`) with rows quantized here and handed
    over as integral floats (scale 1, zero point 128), which its own quantization leaves exact
    (fbgemm's dynamic-quant linear would quantize the whole batch with one scale, making a request's
    output depend on its batch). `fbgemm_matches_int_mm` checks bit-identity with `_int_mm` once per
    process, int16 saturation included. Where it fails (AVX2 fbgemm saturates int16 pair sums), rows go
    through csrc/avx2_gemv.cpp (native.py `avx2_kernels`), an exact int8 GEMM giving `_int_mm`'s int32:
    a generated row is quantized, refined and computed as on every other CPU, whatever its batch. It
    serves prompt chunks too (on a CPU with AVX-VNNI, `_int_mm` takes those past GEMV_MAX_ROWS rows), and
    replaced what ran there before: generated rows through `_weight_int8pack_mm` (bf16 activations,
    ~3.4 GB/s over a 136 MB head where the kernel reads ~7) and prompt rows through `exact_int_mm` over
    an fp32 copy of the weights (4 bytes a weight, the kernel's packed copy 1). On 2 Zen 3 cores, one
    call: gate_up-shaped rows (9728 x 896) at 16-512 rows 0.21-0.66x the time of `exact_int_mm`,
    down-shaped (896 x 4864) 0.14-0.79x. Through the engine (0.5B, a 1,754-token prompt then 48 greedy
    tokens, old and new code alternating in one hour): time to first token 23-29 s -> 16-18 s, decode
    8.7-11.8 -> 11.2-14.6 tok/s, peak RSS 6.3 -> 4.9 GB, the same tokens. Without AVX2, generated rows
    use `_weight_int8pack_mm` and prompt rows `exact_int_mm`.
  * `exact_int_mm` is `_int_mm`'s exact int32 result computed by fp32 GEMMs: int8 values are exact in
    fp32, and so is every partial sum of a K-slice of at most EXACT_K (127 * 127 * 1024 < 2^24), in
    any summation order; the slices' results add up in int32. On a CPU without VNNI, oneDNN's
    `_int_mm` falls back to a slow path (2 threads, AVX2, 512x896 @ 896x4864: 1.13 s against 0.053 s
    for the fp32 GEMM), which made a 1,500-token RAG prompt take minutes to prefill. The fp32 copy of
    the weights (4x the int8 bytes) is made only on such CPUs without AVX2.
In every case the int8 weights are held twice (the GEMV layout and `_int_mm`'s); decode reads one.

Greedy rows (temperature 0, the default) need only the argmax of the lm_head, which is a quarter of a
decode step's bytes (136 of 494 MB for Qwen2.5-0.5B). With the native kernels the head also keeps a
4-bit copy of its weights' high nibbles (+68 MB); `Linear.greedy_logits` streams that, keeps every
token that could still win (a margin of SCREEN_Z standard deviations of the dropped low nibbles'
contribution) and computes those candidates exactly, bit for bit the full head's logits
(csrc/lm_head.cpp has the design note). On the bench's rows: median 2 candidates, the largest
normalized error seen 5.4 of the 8 allowed, the argmax the full head's on every row; the head costs
~6 ms instead of ~11. Sampled rows use the full head.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from assistant.engine.native import avx2_kernels, int8_kernels

EXACT_K = 1024  # exact_int_mm's K-slice: 127 * 127 * EXACT_K < 2**24, the last integer fp32 holds exactly
FBGEMM_MAX_ROWS = 8  # steps with more rows than this use torch._int_mm (see the module docstring)
GEMV_MAX_ROWS = 16  # GEMM rows the AVX2 kernel takes where oneDNN's `_int_mm` has VNNI (AVX-VNNI); all elsewhere
MAX_OUTLIERS = 32  # outlier channels a refined row may keep (csrc/int8_common.h)
SCREEN_Z = 8.0  # candidate margin of the screened greedy head, in standard deviations (csrc/lm_head.cpp)


class Linear:
    """y = x @ W.T + b, with W kept as fp32/bf16 or as per-channel int8 + scales."""

    def __init__(self, weight: torch.Tensor | Sequence[torch.Tensor], bias: torch.Tensor | None, quantize: str | None,
                 dtype: torch.dtype, *, residual: bool = True, outliers: int = 0):
        """`weight` (N, K), or parts of it stacked along the outputs (a fused q/k/v or gate/up)."""
        parts = [weight] if isinstance(weight, torch.Tensor) else list(weight)
        self.bias = None if bias is None else bias.to(dtype)
        self.int8 = quantize == "int8"
        self.residual = residual  # generated rows are refined here (False: one pass for every row)
        if not 0 <= outliers <= MAX_OUTLIERS:
            raise ValueError(f"int8 outliers: 0 to {MAX_OUTLIERS} channels, not {outliers}")
        self.outliers = outliers  # refined rows keep this many channels exact; 0: they get the residual pass
        self.packed = self.native = self.screen = self.exact = self.gemv = self.columns = None
        self.screened_rows = self.screened_candidates = 0  # statistics of `greedy_logits`
        if self.int8:
            on_cpu = parts[0].device.type == "cpu"
            if on_cpu and dtype == torch.float32 and (ext := int8_kernels()) is not None:
                self.native = ext  # the fused kernel (native.py); the int8 weights serve steps past its rows
                # the numbers of the torch ops below, in one parallel pass that packs them too
                self.weight, self.scale, self.vnni = ext.quantize_pack([p.float() for p in parts])
                self.bias = None if bias is None else self.bias.contiguous()  # the kernel reads it raw
                return
            w = torch.cat(parts).float()
            self.scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # (N,) fp32
            self.weight = torch.round(w / self.scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # (N, K)
            if on_cpu and fbgemm_matches_int_mm():
                self.packed = fbgemm_pack(self.weight, self.scale)
                return
            if on_cpu and (avx2 := avx2_kernels()) is not None:  # decode rows: int8 as well, exact
                self.gemv = (avx2, avx2.gemv_pack(self.weight))  # every row through the AVX2 kernel
            elif on_cpu and not int_mm_is_fast():
                self.exact = exact_slices(self.weight)
        else:
            self.weight = torch.cat(parts).to(dtype).contiguous()

    def __call__(self, x: torch.Tensor, rows: "RowSplit | None" = None) -> torch.Tensor:  # (T, K) -> (T, N)
        if not self.int8:
            return F.linear(x, self.weight, self.bias)
        if rows is not None and not self.residual:
            rows = rows.one_pass
        if self.native is not None:
            return self._native(x, rows)
        if self.packed is not None or self.gemv is not None:  # generated tokens (and every lm_head row): residual pass
            y = self._int8(x, slice(None) if rows is None or (rows.prompt is None and rows.num_refined)
                           else rows.decode if rows.num_refined else None)
        elif rows is None or rows.prompt is None:
            y = self._weight_only(x)
        elif rows.decode is None:
            y = self._int8(x, None)
        else:
            y = x.new_empty(x.size(0), self.weight.size(0))
            y[rows.prompt] = self._int8(x[rows.prompt], None)
            y[rows.decode] = self._weight_only(x[rows.decode])
        return y if self.bias is None else y + self.bias

    def _int8(self, x: torch.Tensor, refine: "torch.Tensor | slice | None") -> torch.Tensor:
        """Per-row int8 activations; the rows in `refine` (all of them: slice(None)) also get their
        quantization residual, at 1/254 of the row's step, as extra rows of the same GEMM, or with
        `outliers` keep their largest channels exact (module docstring). Every op costs microseconds on a
        decode step's few rows: fewest ops wins."""
        if refine is not None and self.outliers:
            return self._int8_outliers(x, torch.arange(x.size(0))[refine])
        n = x.size(0)
        x_scale = x.float().abs().amax(dim=1, keepdim=True).clamp_min_(1e-8).div_(127.0)  # (n, 1)
        u = torch.div(x, x_scale)  # in [-127, 127]
        if refine is None:
            xq = u.round_()
        elif isinstance(refine, slice):  # a pure decode step: every row, no gathers
            xq = torch.empty(2 * n, x.size(1), dtype=u.dtype, device=u.device)
            torch.round(u, out=xq[:n])
            torch.sub(u, xq[:n], out=xq[n:]).mul_(254.0).round_()
        else:
            head = torch.round(u)
            xq = torch.cat([head, (u[refine] - head[refine]).mul_(254.0).round_()])
        if self.packed is not None and xq.size(0) <= FBGEMM_MAX_ROWS:
            acc = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(xq, 1.0, 128, self.packed)
        elif self.gemv is not None and (xq.size(0) <= GEMV_MAX_ROWS or not int_mm_is_fast()):
            ext, packed = self.gemv
            acc = ext.gemv(xq.to(torch.int8), packed, self.weight.size(0)).float().mul_(self.scale)
        elif self.exact is not None:
            acc = exact_int_mm(xq, self.exact).float().mul_(self.scale)
        else:
            acc = torch._int_mm(xq.to(torch.int8), self.weight.t()).float().mul_(self.scale)
        # acc = float(int32 dot) * channel scale, as fbgemm computes it; the residual rows count 1/254
        if refine is None:
            y = acc
        elif isinstance(refine, slice):
            y = torch.add(acc[:n], acc[n:], alpha=1 / 254.0)
        else:
            y = acc[:n].index_add_(0, refine, acc[n:], alpha=1 / 254.0)
        return y.mul_(x_scale).to(x.dtype)  # then each row's own scale

    def _int8_outliers(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`_int8` where the rows `rows` keep their `outliers` largest |x| channels exact: those are zeroed
        before the rows are quantized (so they no longer set the row's scale) and added back in fp32
        through the int8 weights' columns, summed in ascending channel order (as csrc/int8_common.h)."""
        picked = x[rows].float()
        idx = largest(picked.abs(), self.outliers)  # (R, m)
        vals = picked.gather(1, idx)
        rest = x.clone()
        rest[rows] = picked.scatter(1, idx, 0.0).to(x.dtype)
        y = self._int8(rest, None)
        if self.columns is None:  # the weights by input channel: 16 columns of a down-shaped weight in 26 us, not 122
            self.columns = self.weight.t().contiguous()
        columns = self.columns[idx].float()  # (R, m, N)
        sums = torch.zeros(rows.numel(), self.weight.size(0))
        for k in range(idx.size(1)):
            sums += vals[:, k:k + 1] * columns[:, k]
        y[rows] += (sums * self.scale).to(y.dtype)
        return y

    def _native(self, x: torch.Tensor, rows: "RowSplit | None") -> torch.Tensor:
        """The fused kernel for up to its MAX_ROWS GEMM rows, else torch._int_mm between the kernel's own
        quantization and epilogue: the same arithmetic, so the same row either way."""
        refine, refined = (rows.refine, rows.num_refined) if rows is not None else (all_rows(x.size(0)), x.size(0))
        outliers = self.outliers if refined else 0
        if x.size(0) + (0 if outliers else refined) <= self.native.MAX_ROWS:
            return self.native.linear(x, self.vnni, self.scale, self.bias, refine, outliers)
        q = self.native.quantize(x, refine, outliers)  # with outliers: their channels and values as q[2], q[3]
        if hasattr(self.native, "int_mm_finish") and not int_mm_is_fast():
            # the AVX2 build's own exact GEMM (oneDNN's `_int_mm` without VNNI takes a slow path), with the
            # epilogue applied strip by strip
            return self.native.int_mm_finish(q[0], self.vnni, self.scale, q[1], refine, self.bias,
                                             *((q[2], q[3]) if outliers else (None, None)))
        extra = (self.vnni, q[2], q[3]) if outliers else (None, None, None)
        return self.native.finish(torch._int_mm(q[0], self.weight.t()), self.scale, q[1], refine, self.bias, *extra)

    def prepare_greedy(self) -> None:
        """Pack the 4-bit screening copy for `greedy_logits` (native int8 only; +half the int8 bytes)."""
        if self.native is not None:
            packed, mean, sd = self.native.head_pack(self.weight)
            self.screen = (packed, mean, (sd * self.scale).contiguous())

    def greedy_logits(self, x: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        """Logits whose argmax is the full layer's for the rows in `greedy` (bool (n,)), reading half the
        bytes: exact values for the screened candidates, -inf for the rest (csrc/lm_head.cpp); other
        rows get the full layer. Used for the lm_head of greedy decode rows."""
        if self.screen is None or not bool(greedy.any()):
            return self(x)
        packed, mean, margin = self.screen
        every = bool(greedy.all())
        logits, counts = self.native.head_greedy(x if every else x[greedy], packed, mean, margin, self.weight,
                                                 self.scale, self.bias, SCREEN_Z)
        self.screened_rows += counts.numel()
        self.screened_candidates += int(counts.sum())
        if every:
            return logits
        out = x.new_empty(x.size(0), self.weight.size(0))
        out[greedy], out[~greedy] = logits, self(x[~greedy])
        return out

    def _weight_only(self, x: torch.Tensor) -> torch.Tensor:  # the fallback decode kernel without fbgemm
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scale.to(torch.bfloat16)).to(x.dtype)


def largest(a: torch.Tensor, m: int) -> torch.Tensor:
    """The indices of the m largest values of each row of `a` (R, K), ties to the lower index, in ascending
    index order: a stable descending sort's first m, sorted (csrc/int8_common.h `take_outliers`), from
    one topk for the m-th largest value instead of a sort of the whole row (~4x less time for K = 4,864)."""
    m = min(m, a.size(1))
    a = a.nan_to_num(nan=-1.0)  # never a NaN (the rows here are absolute values: -1 is below all of them)
    floor = a.topk(m, dim=1).values[:, -1:]  # the m-th largest of each row
    above = a > floor
    tied = a == floor  # of these, the lowest indices fill the row up to m
    chosen = above | (tied & (tied.cumsum(1) <= m - above.sum(1, keepdim=True)))
    return chosen.nonzero()[:, 1].view(a.size(0), m)


def exact_slices(weight: torch.Tensor) -> list[torch.Tensor]:
    """The int8 weights (N, K) as fp32 K-slices of at most EXACT_K columns, for `exact_int_mm`."""
    return [w.float().contiguous() for w in weight.split(EXACT_K, dim=1)]


def exact_int_mm(xq: torch.Tensor, slices: list[torch.Tensor]) -> torch.Tensor:
    """`torch._int_mm(xq, W.T)` bit for bit, for integral xq in [-127, 127] (any float dtype), from fp32
    GEMMs over K-slices whose sums are exact (module docstring). Returns int32 (T, N)."""
    x = xq.float()
    out, k = None, 0
    for w in slices:
        part = F.linear(x[:, k:k + w.size(1)], w).to(torch.int32)
        out = part if out is None else out.add_(part)
        k += w.size(1)
    return out


@functools.cache
def int_mm_is_fast() -> bool:
    """Whether oneDNN runs `_int_mm` with VNNI here (where it does not, prefill goes through
    `exact_int_mm`). ASSISTANT_ENGINE_INT_MM=exact|int_mm overrides the probe."""
    import os

    forced = os.environ.get("ASSISTANT_ENGINE_INT_MM", "")
    if forced in ("exact", "int_mm"):
        return forced == "int_mm"
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return True
    return "avx512_vnni" in flags or "avx_vnni" in flags or "amx_int8" in flags


def fbgemm_pack(weight: torch.Tensor, scale: torch.Tensor) -> Any:
    """Prepack int8 (N, K) weights with per-channel scales for fbgemm."""
    import warnings

    previous = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "fbgemm"
        with warnings.catch_warnings():  # per-channel qint8 tensors are flagged as deprecated API
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(
                weight, scale.double(), torch.zeros(weight.size(0), dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(qweight, None)
    finally:
        torch.backends.quantized.engine = previous


@functools.cache
def fbgemm_matches_int_mm() -> bool:
    """Whether fbgemm is present and gives rows bit-identical to the `_int_mm` path on this CPU,
    including the worst case for int16 saturation (all-positive activations times +127 weights)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (48, 1024), generator=gen, dtype=torch.int8)
    weight[0] = 127
    scale = torch.rand(48, generator=gen) / 100 + 1e-4
    probe = Linear.__new__(Linear)
    probe.bias, probe.int8, probe.weight, probe.scale, probe.exact, probe.outliers = None, True, weight, scale, None, 0
    probe.gemv = probe.columns = None
    try:
        probe.packed = fbgemm_pack(weight, scale)
    except Exception:  # noqa: BLE001 - an fbgemm that cannot pack here is an fbgemm we do not use
        return False
    x = torch.randn(3, 1024, generator=gen) * 5
    x[0] = x[0].abs()
    small = probe._int8(x, slice(None))  # 6 rows: fbgemm
    probe.packed = None
    return torch.equal(small, probe._int8(x, slice(None)))  # _int_mm


@dataclass(frozen=True)
class RowSplit:
    """Which rows of a step are prompt tokens; None where a group is empty."""

    prompt: torch.Tensor | None  # (P,) row indices
    decode: torch.Tensor | None  # (T - P,) row indices
    refine: torch.Tensor  # (T,) bool: the rows that get the residual pass (generated tokens)
    num_refined: int

    @functools.cached_property
    def one_pass(self) -> "RowSplit":
        """The same rows for a linear without the residual pass (`Linear.residual`): none refined."""
        return RowSplit(self.prompt, self.decode, torch.zeros_like(self.refine), 0)

    @classmethod
    def from_mask(cls, is_prompt: torch.Tensor) -> "RowSplit":
        prompt = is_prompt.nonzero().squeeze(1)
        decode = (~is_prompt).nonzero().squeeze(1)
        return cls(prompt if prompt.numel() else None, decode if decode.numel() else None, ~is_prompt, decode.numel())


@functools.lru_cache(maxsize=64)
def all_rows(n: int) -> torch.Tensor:
    """A refine mask selecting every row (lm_head rows; calls without a RowSplit)."""
    return torch.ones(n, dtype=torch.bool)
