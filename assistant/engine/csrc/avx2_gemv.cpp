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
//     rows of a tile, and the tiles of a block reuse it from L1/L2. The loop is avx2_strips.h, shared with the
//     native kernels' AVX2 build (int8_linear.cpp `int_mm`).
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

#include "avx2_strips.h"
#include "pool.h"

namespace {

constexpr int64_t OUT = 16;   // outputs per block
constexpr int64_t BYTES = 64; // one block's bytes per 4 inputs

// int8 (N, K) -> (ceil(N / 16), ceil(K / 4), 16, 4) bytes, zero-padded.
torch::Tensor gemv_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8, "gemv_pack: int8 (N, K) weights");
  const int64_t N = w.size(0), K = w.size(1), NB = (N + OUT - 1) / OUT, K4 = (K + 3) / 4;
  auto padded = torch::zeros({NB * OUT, K4 * 4}, torch::kInt8);
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({NB, OUT, K4, 4}).permute({0, 2, 1, 3}).contiguous().view({NB, K4, BYTES});
}

// torch._int_mm(xq, W.T) for int8 rows xq (R, K) in [-127, 127] and `packed` = gemv_pack(W) with N outputs.
torch::Tensor gemv(torch::Tensor xq, torch::Tensor packed, int64_t N) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == torch::kInt8, "gemv: int8 (R, K) rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == BYTES && packed.size(0) * OUT >= N, "gemv: weights from gemv_pack");
  const int64_t K4 = packed.size(1);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>());
  return int8k::strip_gemm(xq, N, K4, BYTES, false, [&](int64_t b) { return w + b * K4 * BYTES; });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("gemv_pack", &gemv_pack, nogil, "int8 (N, K) -> blocks of 16 outputs x 4 inputs");
  m.def("gemv", &gemv, nogil, "torch._int_mm(xq, W.T), exact, for int8 rows in [-127, 127]");
  m.def("set_threads", [](int n) { int8k::pool().resize(n); }, nogil, "threads the kernel splits its work over");
  m.def("threads", [] { return int8k::pool().threads(); }, "threads the kernel splits its work over");
}
