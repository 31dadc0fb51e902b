// The exact int8 GEMM of the AVX2 kernels, shared by avx2_gemv.cpp (its own packed copy) and the native kernels'
// AVX2 build (int8_linear.cpp `int_mm`, over `pack`'s layout): y = x . W^T for int8 rows x in [-127, 127] and
// weights in strips of 16 outputs, strip s's word group kg (16 outputs x 4 inputs, 64 bytes) at base(s) + kg * stride.
// vpmaddubsw takes |x| unsigned and the weight with x's sign (vpsignb) signed, so a pair sum stays within
// 2 * 127 * 127 < 32,767 (avx2_gemv.cpp's design note); `flip` weights are stored + 128 (xor 0x80 gives them back).
// Tiles of 4 rows keep 8 accumulators in the 16 ymm registers; a strip's bytes stay in L1/L2 across its tiles.
#pragma once
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "pool.h"

namespace int8k {

template <class Base>
torch::Tensor strip_gemm(torch::Tensor xq, int64_t N, int64_t K4, int64_t stride, bool flip, const Base& base) {
  const int64_t R = xq.size(0), K = xq.size(1), strips = (N + 15) / 16;
  TORCH_CHECK((K + 3) / 4 == K4, "int8 GEMM: rows of ", K, " inputs for weights of ", 4 * K4);
  auto words = torch::zeros({R, K4 * 4}, torch::kInt8);  // the rows as 4-byte words, K padded with zeros
  words.narrow(1, 0, K).copy_(xq);
  auto y = torch::empty({R, N}, torch::kInt32);
  const int32_t* x = reinterpret_cast<const int32_t*>(words.data_ptr<int8_t>());
  int32_t* out = y.data_ptr<int32_t>();
  parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i mask = _mm256_set1_epi8(static_cast<char>(flip ? 0x80 : 0));
    for (int64_t s = s0; s < s1; ++s) {
      const uint8_t* ws = base(s);
      const int64_t valid = std::min<int64_t>(16, N - s * 16);
      for (int64_t r0 = 0; r0 < R; r0 += 4) {
        const int rows = static_cast<int>(std::min<int64_t>(4, R - r0));
        __m256i acc[4][2];
        for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int64_t kg = 0; kg < K4; ++kg) {
          const uint8_t* p = ws + kg * stride;
          const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), mask);
          const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), mask);
          for (int r = 0; r < 4; ++r) {
            if (r >= rows) break;
            const __m256i xv = _mm256_set1_epi32(x[(r0 + r) * K4 + kg]), ax = _mm256_abs_epi8(xv);
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xv)), ones));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xv)), ones));
          }
        }
        for (int r = 0; r < rows; ++r) {
          alignas(32) int32_t tmp[16];
          _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), acc[r][0]);
          _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + 8), acc[r][1]);
          std::memcpy(out + (r0 + r) * N + s * 16, tmp, valid * sizeof(int32_t));
        }
      }
    }
  });
  return y;
}

}  // namespace int8k
