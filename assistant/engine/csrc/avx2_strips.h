// The exact int8 GEMM of the AVX2 kernels, shared by avx2_gemv.cpp (its own packed copy) and the native kernels'
// AVX2 build (int8_linear.cpp `int_mm`, over `pack`'s layout): y = x . W^T for int8 rows x in [-127, 127] and
// weights in strips of 16 outputs, strip s's word group kg (16 outputs x 4 inputs, 64 bytes) at base(s) + kg * stride.
// vpmaddubsw takes |x| unsigned and the weight with x's sign (vpsignb) signed, so a pair sum stays within
// 2 * 127 * 127 < 32,767 (avx2_gemv.cpp's design note); `flip` weights are stored + 128 (xor 0x80 gives them back).
// Tiles of STRIP_TILE rows keep their accumulators in ymm registers; a strip's bytes stay in L1/L2 across its tiles.
#pragma once
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "pool.h"

namespace int8k {

// Strips are claimed in chunks of a few: with the pool's usual 4 chunks per thread, 7% of a prompt's time was
// one thread waiting for the other's last chunk (py-spy, 2 cores).
constexpr int GEMM_CHUNKS_PER_THREAD = 32;
constexpr int STRIP_TILE = 3;  // rows per tile: 6 accumulators + 2 weight registers. Measured
// standalone (512 x 896 @ 896 x 9728, 2 threads), GMAC/s by tile rows: 3: 131, 5: 126, 2: 124, 4: 120, 6: 114

// One tile: `rows` (<= T) rows of x against one strip, written to out (row stride N, `valid` outputs). Full tiles
// (rows == T) run the unrolled loop; the last, shorter tile of a GEMM a loop the compiler cannot unroll. The
// accumulators are the function's own, not the caller's through a reference, so they can stay in registers.
template <int T>
inline void strip_tile(const int32_t* x, const int32_t* xabs, int64_t K4, int rows, const uint8_t* ws, int64_t stride,
                       __m256i mask, int32_t* out, int64_t N, int64_t valid) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[T][2];
  for (int r = 0; r < T; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  auto step = [&](int r, int64_t kg, __m256i w0, __m256i w1) {
    const __m256i xv = _mm256_set1_epi32(x[r * K4 + kg]), ax = _mm256_set1_epi32(xabs[r * K4 + kg]);
    acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xv)), ones));
    acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xv)), ones));
  };
  if (rows == T) {
    for (int64_t kg = 0; kg < K4; ++kg) {
      const uint8_t* p = ws + kg * stride;
      const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), mask);
      const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), mask);
#pragma GCC unroll 8
      for (int r = 0; r < T; ++r) step(r, kg, w0, w1);
    }
  } else {
    for (int64_t kg = 0; kg < K4; ++kg) {
      const uint8_t* p = ws + kg * stride;
      const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), mask);
      const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), mask);
      for (int r = 0; r < rows; ++r) step(r, kg, w0, w1);
    }
  }
  for (int r = 0; r < rows; ++r) {
    alignas(32) int32_t tmp[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), acc[r][0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + 8), acc[r][1]);
    std::memcpy(out + r * N, tmp, valid * sizeof(int32_t));
  }
}

// y = x . W^T strip by strip: `sink(s, acc)` takes strip s's accumulators, acc (R, 16) int32 (outputs past N are
// those of zero weights), in a buffer of the calling thread's.
template <class Base, class Sink>
void strip_gemm_each(torch::Tensor xq, int64_t N, int64_t K4, int64_t stride, bool flip, const Base& base,
                     const Sink& sink) {
  const int64_t R = xq.size(0), K = xq.size(1), strips = (N + 15) / 16;
  TORCH_CHECK((K + 3) / 4 == K4, "int8 GEMM: rows of ", K, " inputs for weights of ", 4 * K4);
  auto words = torch::zeros({R, K4 * 4}, torch::kInt8);  // the rows as 4-byte words, K padded with zeros
  words.narrow(1, 0, K).copy_(xq);
  auto magnitudes = words.abs();  // |x|, vpmaddubsw's unsigned side, read rather than recomputed per strip
  const int32_t* x = reinterpret_cast<const int32_t*>(words.data_ptr<int8_t>());
  const int32_t* xabs = reinterpret_cast<const int32_t*>(magnitudes.data_ptr<int8_t>());
  parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    const __m256i mask = _mm256_set1_epi8(static_cast<char>(flip ? 0x80 : 0));
    std::vector<int32_t> acc(R * 16);
    for (int64_t s = s0; s < s1; ++s) {
      for (int64_t r0 = 0; r0 < R; r0 += STRIP_TILE) {
        const int rows = static_cast<int>(std::min<int64_t>(STRIP_TILE, R - r0));
        strip_tile<STRIP_TILE>(x + r0 * K4, xabs + r0 * K4, K4, rows, base(s), stride, mask, acc.data() + r0 * 16, 16, 16);
      }
      sink(s, acc.data());
    }
  }, GEMM_CHUNKS_PER_THREAD);
}

// y int32 (R, N) = x . W^T
template <class Base>
torch::Tensor strip_gemm(torch::Tensor xq, int64_t N, int64_t K4, int64_t stride, bool flip, const Base& base) {
  auto y = torch::empty({xq.size(0), N}, torch::kInt32);
  int32_t* out = y.data_ptr<int32_t>();
  strip_gemm_each(xq, N, K4, stride, flip, base, [&](int64_t s, const int32_t* acc) {
    const int64_t valid = std::min<int64_t>(16, N - s * 16);
    for (int64_t r = 0; r < xq.size(0); ++r) std::memcpy(out + r * N + s * 16, acc + r * 16, valid * sizeof(int32_t));
  });
  return y;
}

}  // namespace int8k
