// int8 linear layers for the engine's decode steps: AVX-512 VNNI GEMV with the row quantization and the
// epilogue fused into one call (see assistant/engine/native.py for why this is hand-written).
//
// Arithmetic, identical on every path so that a row's output never depends on the kernel or the batch:
//   s      = max(max|x|, 1e-8) / 127                       per row
//   u      = x / s ; q = round_half_even(u)                int8 in [-127, 127]
//   r      = round_half_even((u - q) * 254)                 residual, for rows that get the second pass
//   a0, a1 = exact int32 dot products of q, r with the int8 weight row
//   y      = ((float(a0) * ws) + (float(a1) * ws) * (1/254)) * s + bias     (one-pass rows: float(a0) * ws * s + bias)
// `quantize` + torch._int_mm + `finish` (prefill) and `linear` (<= MAX_ROWS rows) both compute exactly this;
// IEEE operations in a fixed order, built with -ffp-contract=off so no FMA can change a rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <vector>

#include "int8_common.h"
#include "native.h"

namespace {

using int8k::BLOCK;
using int8k::MAX_ROWS;
using int8k::epilogue16;
using int8k::quantize_row;
using int8k::tail_mask;

constexpr int64_t PREFETCH = 8192;  // bytes ahead of the weight stream (measured: 4-8 KB best here)
constexpr int64_t GROUP = 8;        // GEMM rows per pass over a block (measured: one pass of 8 rows beats two of 4)

// R (<= GROUP) rows of one block of 64 outputs: weights packed as (K4, 64, 4) int8, x as R rows of K4 u8x4
// words; exact int32 dot products into out[r][0:64].
template <int R>
void group(const int8_t* w, const int32_t* xb, int64_t K4, const int32_t* comp, int32_t (*out)[BLOCK]) {
  __m512i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int64_t kg = 0; kg < K4; ++kg) {
    const int8_t* p = w + kg * 256;
    for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH + 64 * j), _MM_HINT_T1);
    const __m512i w0 = _mm512_loadu_si512(p), w1 = _mm512_loadu_si512(p + 64), w2 = _mm512_loadu_si512(p + 128),
                  w3 = _mm512_loadu_si512(p + 192);
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(xb[r * K4 + kg]);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xv, w1);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], xv, w2);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], xv, w3);
    }
  }
  for (int r = 0; r < R; ++r)  // (q + 128) . w - 128 * sum(w) == q . w, exactly
    for (int j = 0; j < 4; ++j)
      _mm512_store_si512(out[r] + 16 * j, _mm512_sub_epi32(acc[r][j], _mm512_loadu_si512(comp + 16 * j)));
}

struct Rows {
  int64_t n;                  // activation rows
  std::vector<int64_t> res;   // res[i]: index of row i's residual row among the GEMM rows, or -1
  int64_t total;              // GEMM rows: activation rows + residual rows
};

// One block of 64 outputs for every GEMM row, GROUP rows per pass over the block's weights (the first pass
// streams them from memory, the next ones find them in L2), int32 results into acc (MAX_ROWS x 64), then
// the epilogue of each activation row with its residual row.
void run_blocks(const Rows& rows, const int8_t* packed, const int32_t* xb, int64_t K4, const int32_t* comp,
                const float* ws, const float* xscale, const float* bias, float* out, int64_t N, int64_t b0, int64_t b1) {
  alignas(64) int32_t acc[MAX_ROWS][BLOCK];
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* wb = packed + b * K4 * 256;
    for (int64_t r0 = 0; r0 < rows.total; r0 += GROUP) {
      switch (std::min(GROUP, rows.total - r0)) {
#define CASE(R) case R: group<R>(wb, xb + r0 * K4, K4, comp + b * BLOCK, acc + r0); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        default: break;
      }
    }
    for (int64_t i = 0; i < rows.n; ++i) {
      const __m512 s = _mm512_set1_ps(xscale[i]);
      for (int j = 0; j < 4; ++j) {
        const int64_t col = b * BLOCK + 16 * j;
        if (col >= N) break;
        const __mmask16 m = tail_mask(N - col);
        const __m512 ws16 = _mm512_maskz_loadu_ps(m, ws + col);
        const bool two_pass = rows.res[i] >= 0;
        const __m512i a1 = two_pass ? _mm512_load_si512(acc[rows.res[i]] + 16 * j) : _mm512_setzero_si512();
        const __m512 y = epilogue16(_mm512_load_si512(acc[i] + 16 * j), two_pass ? &a1 : nullptr, ws16, s,
                                    bias ? bias + col : nullptr, m);
        _mm512_mask_storeu_ps(out + i * N + col, m, y);
      }
    }
  }
}

Rows make_rows(const torch::Tensor& refine, int64_t n) {  // refine: bool (n,) rows that get the residual pass
  Rows rows{n, std::vector<int64_t>(n, -1), n};
  const bool* rp = refine.data_ptr<bool>();
  for (int64_t i = 0; i < n; ++i)
    if (rp[i]) rows.res[i] = rows.total++;
  return rows;
}

}  // namespace

// int8 (N, K) weights -> (blocks, K4, 64, 4) int8 VNNI layout (N padded to 64, K to 4 with zeros) and
// comp = 128 * row sums (int32, padded N), the correction for the kernel's unsigned activations.
torch::Tensor pad_weights(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kInt8 && w.dim() == 2, "the int8 kernels want int8 (N, K) weights");
  const int64_t N = w.size(0), K = w.size(1);
  auto padded = torch::zeros({(N + BLOCK - 1) / BLOCK * BLOCK, (K + 3) / 4 * 4}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded;
}

std::vector<torch::Tensor> pack(torch::Tensor w) {
  auto padded = pad_weights(w);
  const int64_t Np = padded.size(0), Kp = padded.size(1);
  auto comp = (padded.to(torch::kInt32).sum(1) * 128).to(torch::kInt32).contiguous();
  auto packed = padded.view({Np / BLOCK, BLOCK, Kp / 4, 4}).permute({0, 2, 1, 3}).contiguous();
  return {packed, comp};
}

// x fp32 (n, K), refine bool (n,) -> int8 (n + refined, K) rows for torch._int_mm, row scales fp32 (n,)
std::vector<torch::Tensor> quantize(torch::Tensor x, torch::Tensor refine) {
  x = x.contiguous();
  const int64_t n = x.size(0), K = x.size(1);
  const Rows rows = make_rows(refine, n);
  auto xq = torch::empty({rows.total, K}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({n}, x.options());
  for (int64_t i = 0; i < n; ++i)
    quantize_row(x.data_ptr<float>() + i * K, K, scale.data_ptr<float>() + i, xq.data_ptr<int8_t>() + i * K,
                 rows.res[i] >= 0 ? xq.data_ptr<int8_t>() + rows.res[i] * K : nullptr);
  return {xq, scale};
}

// acc int32 (n + refined, N) from torch._int_mm -> fp32 (n, N), the same epilogue as `linear`
torch::Tensor finish(torch::Tensor acc, torch::Tensor ws, torch::Tensor xscale, torch::Tensor refine,
                     c10::optional<torch::Tensor> bias) {
  acc = acc.contiguous();
  const int64_t n = xscale.size(0), N = acc.size(1);
  const Rows rows = make_rows(refine, n);
  auto out = torch::empty({n, N}, ws.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const float* wsp = ws.data_ptr<float>();
  const float* xsp = xscale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const __m512 s = _mm512_set1_ps(xsp[i]);
      for (int64_t col = 0; col < N; col += 16) {
        const __mmask16 m = tail_mask(N - col);
        const __m512i a0 = _mm512_maskz_loadu_epi32(m, ap + i * N + col);
        __m512i a1v;
        if (rows.res[i] >= 0) a1v = _mm512_maskz_loadu_epi32(m, ap + rows.res[i] * N + col);
        const __m512 y = epilogue16(a0, rows.res[i] >= 0 ? &a1v : nullptr, _mm512_maskz_loadu_ps(m, wsp + col), s,
                                    bp ? bp + col : nullptr, m);
        _mm512_mask_storeu_ps(op + i * N + col, m, y);
      }
    }
  });
  return out;
}

// The fused decode linear: x fp32 (n, K) -> fp32 (n, N), n + refined rows <= MAX_ROWS.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor comp, torch::Tensor ws,
                     c10::optional<torch::Tensor> bias, torch::Tensor refine) {
  x = x.contiguous();
  const int64_t n = x.size(0), K = x.size(1), K4 = packed.size(1), blocks = packed.size(0), N = ws.size(0);
  TORCH_CHECK(K4 * 4 >= K && K4 * 4 - K < 4, "linear: activations do not match the packed weights");
  const Rows rows = make_rows(refine, n);
  const int64_t total = rows.total;
  TORCH_CHECK(total <= MAX_ROWS, "linear takes at most ", MAX_ROWS, " GEMM rows");
  std::vector<int8_t> q(total * K4 * 4, 0);  // padded K stays 0
  std::vector<float> xscale(n);
  for (int64_t i = 0; i < n; ++i)
    quantize_row(x.data_ptr<float>() + i * K, K, &xscale[i], q.data() + i * K4 * 4,
                 rows.res[i] >= 0 ? q.data() + rows.res[i] * K4 * 4 : nullptr);
  // q + 128 as u8; padded K becomes 128 too, against zero weights that comp also counts as zero
  for (auto& v : q) v = static_cast<int8_t>(static_cast<uint8_t>(v) ^ 0x80);
  auto out = torch::empty({n, N}, x.options());
  const int32_t* xb = reinterpret_cast<const int32_t*>(q.data());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    const int8_t* pp = packed.data_ptr<int8_t>();
    const int32_t* cp = comp.data_ptr<int32_t>();
    const float* wsp = ws.data_ptr<float>();
    float* op = out.data_ptr<float>();
    run_blocks(rows, pp, xb, K4, cp, wsp, xscale.data(), bp, op, N, b0, b1);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();  // steps run on the engine thread
  m.def("pack", &pack, nogil, "int8 (N, K) -> VNNI-packed weights and the u8 correction");
  m.def("quantize", &quantize, nogil, "rows -> int8 GEMM rows (with residual rows) and row scales");
  m.def("finish", &finish, nogil, "int32 accumulators -> fp32 outputs");
  m.def("linear", &linear, nogil, "fused decode linear (quantize, VNNI GEMV, epilogue)");
  m.def("head_pack", &head_pack, nogil, "int8 head -> its 4-bit high nibbles (VNNI layout) and low-nibble statistics");
  m.def("head_greedy", &head_greedy, nogil, "greedy rows: exact logits of the screened candidates, -inf elsewhere");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm over rows");
  m.def("rope_store", &rope_store, nogil, "rotary embedding of q and k, k and v written to the KV cache");
  m.def("attend", &attend, nogil, "causal attention of a step's queries over paged KV slots");
  m.def("swiglu", &swiglu, nogil, "silu(gate) * up over (T, 2F) rows");
  register_decode_stack(m);
  m.attr("MAX_ROWS") = MAX_ROWS;
}
