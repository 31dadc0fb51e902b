// Exact int8 x int8 -> int32 products on CPUs with AVX2 but without AVX-512 VNNI (most laptops and desktops:
// Intel's client cores since Alder Lake, AMD's before Zen 4): the GEMM of int8.py `Linear._int8`, for a decode
// step's few rows and for prompt chunks, bit for bit `torch._int_mm(xq, W.T)`.
//
// Why hand-written. Without VNNI the engine had no exact int8 kernel for decode rows: oneDNN's `_int_mm` takes a
// slow path (1.13 s for a 512-row prompt chunk, int8.py), fbgemm's AVX2 kernel saturates int16 pair sums, so
// generated rows went through `torch._weight_int8pack_mm` (bf16 activations), which streamed the weights at 2-6
// GB/s where a plain read runs at ~10 (2 Zen 3 cores): 79% of a decode step, and another arithmetic than the
// prompt rows' (int8.py says why one arithmetic for every row matters).
//
// Design note — vpdpbusd by hand, exact:
//   * AVX2's byte multiply, vpmaddubsw, multiplies unsigned by signed bytes and adds pairs into int16 with
//     saturation. Both operands here are in [-127, 127] (`Linear` clamps weights; activations and residuals are
//     rounded into that range), so it gets |x| as the unsigned operand and w with x's sign as the signed one
//     (vpsignb): a pair sum is at most 2 * 127 * 127 = 32,258 < 32,767, never saturated. vpmaddwd against ones
//     widens the pairs to int32 sums of 4 products, and every int32 accumulator stays exact for K < 2^17.
//   * Weights are packed in blocks of 16 outputs x 4 inputs per 64 bytes (K padded to 4, N to 16, zeros), so one
//     row's 4 input bytes, broadcast, meet 8 outputs per vector and the accumulators need no horizontal sum. A
//     tile is one block (2 vectors) by up to 4 rows: 8 accumulators, 2 weight vectors and the broadcasts fit the
//     16 ymm registers. Blocks are split over the kernels' pool (pool.h); each block streams its K once for all
//     rows of a tile, and the tiles of a block reuse it from L1/L2.
//   * Prompt chunks as well: where fp32 GEMMs over an fp32 copy of the weights (`exact_int_mm`) had served them,
//     this ran a chunk of 16-512 rows in 0.14-0.79x their time (gate_up and down shapes, 2 Zen 3 cores), and the
//     fp32 copy (4 bytes a weight) is gone; the packed copy costs 1.
//   * Tried: the same multiply on the row-major weights, no copy (tiles of 3-4 outputs x 1-2 rows, lane sums per
//     output at the end). One call was within ~15-25% of this one, but decode through the engine ran at 8.4-8.7
//     tok/s against 11.3-13.2 (0.5B, alternating runs; that build also gathered the outlier columns ~1.4 ms a
//     step slower), so the copy stays.
#include <torch/extension.h>
#include <immintrin.h>

#include <cstring>

#include "pool.h"

namespace {

constexpr int64_t OUT = 16;   // outputs per block
constexpr int64_t BYTES = 64; // one block's bytes per 4 inputs
constexpr int TILE = 4;       // rows per pass over a block

// int8 (N, K) -> (ceil(N / 16), ceil(K / 4), 16, 4) bytes, zero-padded.
torch::Tensor gemv_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8, "gemv_pack: int8 (N, K) weights");
  const int64_t N = w.size(0), K = w.size(1), NB = (N + OUT - 1) / OUT, K4 = (K + 3) / 4;
  auto padded = torch::zeros({NB * OUT, K4 * 4}, torch::kInt8);
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({NB, OUT, K4, 4}).permute({0, 2, 1, 3}).contiguous().view({NB, K4, BYTES});
}

// acc[r][0..1] = sum over the block's K4 words of w . x_r, for R rows of 4-byte words (x: signed, ax: |x|).
template <int R>
inline void block_tile(const int8_t* w, const int32_t* x, const int32_t* ax, int64_t xs, int64_t K4, int32_t* y,
                       int64_t ys, int64_t valid) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int64_t kg = 0; kg < K4; ++kg) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kg * BYTES));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kg * BYTES + 32));
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_set1_epi32(x[r * xs + kg]), av = _mm256_set1_epi32(ax[r * xs + kg]);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(w0, xv)), ones));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(w1, xv)), ones));
    }
  }
  for (int r = 0; r < R; ++r) {
    if (valid == OUT) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ys), acc[r][0]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ys + 8), acc[r][1]);
    } else {
      alignas(32) int32_t tmp[OUT];
      _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), acc[r][0]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + 8), acc[r][1]);
      std::memcpy(y + r * ys, tmp, valid * sizeof(int32_t));
    }
  }
}

// torch._int_mm(xq, W.T) for int8 rows xq (R, K) in [-127, 127] and `packed` = gemv_pack(W) with N outputs.
torch::Tensor gemv(torch::Tensor xq, torch::Tensor packed, int64_t N) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == torch::kInt8, "gemv: int8 (R, K) rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == BYTES && packed.size(0) * OUT >= N, "gemv: weights from gemv_pack");
  const int64_t R = xq.size(0), K = xq.size(1), K4 = packed.size(1), NB = packed.size(0);
  TORCH_CHECK((K + 3) / 4 == K4, "gemv: rows of ", K, " inputs for weights of ", 4 * K4);
  // the rows as 4-byte words (K padded with zeros), and their absolute values
  auto words = torch::zeros({R, K4 * 4}, torch::kInt8), absw = torch::empty({R, K4 * 4}, torch::kInt8);
  words.narrow(1, 0, K).copy_(xq);
  absw.copy_(words.abs());
  auto y = torch::empty({R, N}, torch::kInt32);
  const int32_t* x = reinterpret_cast<const int32_t*>(words.data_ptr<int8_t>());
  const int32_t* ax = reinterpret_cast<const int32_t*>(absw.data_ptr<int8_t>());
  const int8_t* w = packed.data_ptr<int8_t>();
  int32_t* out = y.data_ptr<int32_t>();
  int8k::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t valid = std::min<int64_t>(OUT, N - b * OUT);
      const int8_t* wb = w + b * K4 * BYTES;
      for (int64_t r0 = 0; r0 < R; r0 += TILE) {
        const int64_t rows = std::min<int64_t>(TILE, R - r0);
        const int32_t* xr = x + r0 * K4;
        const int32_t* ar = ax + r0 * K4;
        int32_t* yr = out + r0 * N + b * OUT;
        switch (rows) {
          case 1: block_tile<1>(wb, xr, ar, K4, K4, yr, N, valid); break;
          case 2: block_tile<2>(wb, xr, ar, K4, K4, yr, N, valid); break;
          case 3: block_tile<3>(wb, xr, ar, K4, K4, yr, N, valid); break;
          default: block_tile<4>(wb, xr, ar, K4, K4, yr, N, valid); break;
        }
      }
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("gemv_pack", &gemv_pack, nogil, "int8 (N, K) -> blocks of 16 outputs x 4 inputs");
  m.def("gemv", &gemv, nogil, "torch._int_mm(xq, W.T), exact, for int8 rows in [-127, 127]");
  m.def("set_threads", [](int n) { int8k::pool().resize(n); }, nogil, "threads the kernel splits its work over");
  m.def("threads", [] { return int8k::pool().threads(); }, "threads the kernel splits its work over");
}
