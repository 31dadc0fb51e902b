// int8 linear layers for the engine's decode steps: AVX-512 VNNI GEMV/GEMM with the row quantization and the
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
//
// Design note: rows at the cost of one. A step with R decode rows (streams, speculated tokens) is R GEMM rows, plus
// R residual rows on the linears that refine generated rows (int8.py: `down`). The weights are streamed from memory
// once per step whatever R is; the multiply-adds grow with R. `vpdpbusd` takes unsigned bytes in its register
// operand and signed bytes in its broadcastable memory operand, so the weights are stored as w + 128 (unsigned) and
// the activations stay signed: (w + 128) . q = w . q + 128 sum(q), one correction per row instead of per output, and
// each row's broadcast rides on the instruction (no register, no extra uop). A tile of TILE_ROWS rows x 64 outputs
// keeps 24 accumulators and the 4 weight vectors in the 32 zmm registers (8 rows spilled: the old kernel's 8-row
// pass cost 2.3x its 4-row pass). Past one tile, a block's K runs in chunks of CHUNK words (8 KB of weights,
// L1-resident): every tile passes over a chunk, its accumulators parked in an L1 buffer between chunks, and each of
// a chunk's T tiles prefetches every T-th word group of the next chunk, so the memory stream keeps flowing under all
// the tiles' multiply-adds instead of waiting for them pass by pass (the old kernel re-read a whole block from L2
// per 8-row pass; with the first tile prefetching the whole next chunk, the stream stalled while the later tiles
// ran: gate_up at 8 rows 14.3-15.2 -> 12.6-13.2 ms, native.py).
// Measured by bench/engine.py's step curve (native.py has the figures).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <vector>

#include "int8_common.h"
#include "native.h"

namespace {

using int8k::BLOCK;
using int8k::MAX_ROWS;
using int8k::TILE_ROWS;
using int8k::epilogue16;
using int8k::quantize_row;
using int8k::tail_mask;

constexpr int64_t PREFETCH = 8192;  // bytes ahead of the weight stream (measured: 4-8 KB best here)
constexpr int64_t CHUNK = 32;       // K words per chunk when a block takes several tiles: 8 KB of weights

// Rows r0 .. r0 + R over K words [k0, k0 + n) of one block (w: the block's packed bytes): accumulators read
// from and written back to acc (zeroed when k0 == 0). Tile `tile` of `tiles` prefetches the word groups
// kg = tile, tile + tiles, ... of the stream ahead (a single tile: every one).
template <int R>
void tile_chunk(const uint8_t* w, const int32_t* x, int64_t K4, int64_t k0, int64_t n, int tile, int tiles,
                int32_t (*acc)[BLOCK]) {
  __m512i a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = k0 ? _mm512_load_si512(acc[r] + 16 * j) : _mm512_setzero_si512();
  const uint8_t* base = w + k0 * 256;
  if (tiles == 1) {
    int8k::dot_tile<R>([&](int64_t kg, __m512i (&v)[4]) {
      const uint8_t* p = base + kg * 256;
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH + 64 * j), _MM_HINT_T1);
      for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_si512(p + 64 * j);
    }, x + k0, K4, n, a);
  } else {
    int64_t next = tile;
    int8k::dot_tile<R>([&](int64_t kg, __m512i (&v)[4]) {
      const uint8_t* p = base + kg * 256;
      if (kg == next) {
        for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH + 64 * j), _MM_HINT_T1);
        next += tiles;
      }
      for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_si512(p + 64 * j);
    }, x + k0, K4, n, a);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_store_si512(acc[r] + 16 * j, a[r][j]);
}

struct Rows {
  int64_t n;                  // activation rows
  std::vector<int64_t> res;   // res[i]: index of row i's residual row among the GEMM rows, or -1
  int64_t total;              // GEMM rows: activation rows + residual rows
};

// Every GEMM row over blocks [b0, b1) of 64 outputs (see the design note), then the epilogue of each activation
// row with its residual row. corr[g] = 128 * sum of GEMM row g's bytes (the weights' +128).
void run_blocks(const Rows& rows, const uint8_t* packed, const int32_t* xb, int64_t K4, const int32_t* corr,
                const float* ws, const float* xscale, const float* bias, float* out, int64_t N, int64_t b0, int64_t b1) {
  alignas(64) int32_t acc[MAX_ROWS][BLOCK];
  const int64_t chunk = rows.total <= TILE_ROWS ? K4 : CHUNK;
  const int tiles = static_cast<int>((rows.total + TILE_ROWS - 1) / TILE_ROWS);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = packed + b * K4 * 256;
    for (int64_t k0 = 0; k0 < K4; k0 += chunk) {
      const int64_t n = std::min(chunk, K4 - k0);
      int tile = 0;
      int8k::for_each_tile(rows.total, [&](int64_t r0, int64_t R) {
        int8k::dispatch_rows(R, [&]<int T>() {
          tile_chunk<T>(wb, xb + r0 * K4, K4, k0, n, tile, tiles, acc + r0);
        });
        ++tile;
      });
    }
    for (int64_t i = 0; i < rows.n; ++i) {
      const __m512 s = _mm512_set1_ps(xscale[i]);
      const bool two_pass = rows.res[i] >= 0;
      const __m512i c0 = _mm512_set1_epi32(corr[i]), c1 = _mm512_set1_epi32(two_pass ? corr[rows.res[i]] : 0);
      for (int j = 0; j < 4; ++j) {
        const int64_t col = b * BLOCK + 16 * j;
        if (col >= N) break;
        const __mmask16 m = tail_mask(N - col);
        const __m512 ws16 = _mm512_maskz_loadu_ps(m, ws + col);
        const __m512i a1 = two_pass ? _mm512_sub_epi32(_mm512_load_si512(acc[rows.res[i]] + 16 * j), c1)
                                    : _mm512_setzero_si512();
        const __m512 y = epilogue16(_mm512_sub_epi32(_mm512_load_si512(acc[i] + 16 * j), c0), two_pass ? &a1 : nullptr,
                                    ws16, s, bias ? bias + col : nullptr, m);
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

// int8 (N, K) weights -> zeros-padded (N to BLOCK outputs, K to 4 inputs)
torch::Tensor pad_weights(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kInt8 && w.dim() == 2, "the int8 kernels want int8 (N, K) weights");
  const int64_t N = w.size(0), K = w.size(1);
  auto padded = torch::zeros({(N + BLOCK - 1) / BLOCK * BLOCK, (K + 3) / 4 * 4}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded;
}

// int8 (N, K) weights -> w + 128 as u8 in the VNNI block layout (blocks, K4, 64, 4) (padding: 128, against
// activations that are 0 there)
torch::Tensor pack(torch::Tensor w) {
  auto padded = pad_weights(w);
  const int64_t Np = padded.size(0), Kp = padded.size(1);
  auto u = (padded.to(torch::kInt16) + 128).to(torch::kUInt8);
  return u.view({Np / BLOCK, BLOCK, Kp / 4, 4}).permute({0, 2, 1, 3}).contiguous();
}

// x fp32 (n, K), refine bool (n,) -> int8 (n + refined, K) rows for torch._int_mm, row scales fp32 (n,)
std::vector<torch::Tensor> quantize(torch::Tensor x, torch::Tensor refine) {
  x = x.contiguous();
  const int64_t n = x.size(0), K = x.size(1);
  const Rows rows = make_rows(refine, n);
  auto xq = torch::empty({rows.total, K}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({n}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      quantize_row(xp + i * K, K, sp + i, qp + i * K, rows.res[i] >= 0 ? qp + rows.res[i] * K : nullptr);
  });
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
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor ws, c10::optional<torch::Tensor> bias,
                     torch::Tensor refine) {
  x = x.contiguous();
  const int64_t n = x.size(0), K = x.size(1), K4 = packed.size(1), blocks = packed.size(0), N = ws.size(0);
  TORCH_CHECK(packed.dtype() == torch::kUInt8, "linear: packed weights come from `pack`");
  TORCH_CHECK(K4 * 4 >= K && K4 * 4 - K < 4, "linear: activations do not match the packed weights");
  const Rows rows = make_rows(refine, n);
  const int64_t total = rows.total;
  TORCH_CHECK(total <= MAX_ROWS, "linear takes at most ", MAX_ROWS, " GEMM rows");
  std::vector<int8_t> q(total * K4 * 4, 0);  // padded K stays 0
  std::vector<float> xscale(n);
  std::vector<int32_t> corr(total);  // 128 * sum(q) per GEMM row: the weights' + 128
  for (int64_t i = 0; i < n; ++i) {
    const bool two_pass = rows.res[i] >= 0;
    const int8k::RowSums sums = quantize_row(x.data_ptr<float>() + i * K, K, &xscale[i], q.data() + i * K4 * 4,
                                             two_pass ? q.data() + rows.res[i] * K4 * 4 : nullptr);
    corr[i] = 128 * sums.q;
    if (two_pass) corr[rows.res[i]] = 128 * sums.r;
  }
  auto out = torch::empty({n, N}, x.options());
  const int32_t* xb = reinterpret_cast<const int32_t*>(q.data());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    run_blocks(rows, packed.data_ptr<uint8_t>(), xb, K4, corr.data(), ws.data_ptr<float>(), xscale.data(), bp,
               out.data_ptr<float>(), N, b0, b1);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();  // steps run on the engine thread
  m.def("pack", &pack, nogil, "int8 (N, K) -> VNNI-packed weights + 128 (u8)");
  m.def("quantize", &quantize, nogil, "rows -> int8 GEMM rows (with residual rows) and row scales");
  m.def("finish", &finish, nogil, "int32 accumulators -> fp32 outputs");
  m.def("linear", &linear, nogil, "fused decode linear (quantize, VNNI GEMV, epilogue)");
  m.def("head_pack", &head_pack, nogil, "int8 head -> its 4-bit high nibbles (VNNI layout) and low-nibble statistics");
  m.def("head_greedy", &head_greedy, nogil, "greedy rows: exact logits of the screened candidates, -inf elsewhere");
  m.def("argmax_rows", &argmax_rows, nogil, "torch.argmax(logits, -1) of fp32 (n, V) logits, in one AVX-512 pass");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm over rows");
  m.def("rope_store", &rope_store, nogil, "rotary embedding of q and k, k and v written to the KV cache");
  m.def("attend", &attend, nogil, "causal attention of a step's queries over paged KV slots");
  m.def("swiglu", &swiglu, nogil, "silu(gate) * up over (T, 2F) rows");
  register_decode_stack(m);
  m.attr("MAX_ROWS") = MAX_ROWS;
}
