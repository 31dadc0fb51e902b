// Shared by the int8 kernels (int8_linear.cpp, lm_head.cpp): the row quantization and the float epilogue that
// every path uses, so that a row's output never depends on the kernel that computed it.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace int8k {

constexpr int64_t BLOCK = 64;    // outputs per packed block: 4 zmm accumulators of 16 int32
constexpr int64_t MAX_ROWS = 8;  // GEMM rows one kernel call takes (activation + residual rows)
constexpr float RESIDUAL_STEP = 1.f / 254.f;

// Per-row quantization into s8 (q) and the residual at 1/254 of the step (r, when r_out is given).
inline void quantize_row(const float* x, int64_t K, float* scale_out, int8_t* q_out, int8_t* r_out) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float s = std::max(amax, 1e-8f) / 127.f;
  *scale_out = s;
  for (int64_t k = 0; k < K; ++k) {
    const float u = x[k] / s;
    const float q = std::nearbyint(u);
    q_out[k] = static_cast<int8_t>(q);
    if (r_out) r_out[k] = static_cast<int8_t>(std::nearbyint((u - q) * 254.f));
  }
}

// y[0:16] for one row from int32 accumulators (a1 == nullptr: one-pass row).
inline __m512 epilogue16(__m512i a0, const __m512i* a1, __m512 ws, __m512 s, const float* bias, __mmask16 m) {
  __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(a0), ws);
  if (a1) y = _mm512_add_ps(y, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(*a1), ws), _mm512_set1_ps(RESIDUAL_STEP)));
  y = _mm512_mul_ps(y, s);
  if (bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, bias));
  return y;
}

// The same arithmetic for one output of a two-pass row (IEEE ops in the same order; built without FMA contraction).
inline float epilogue1(int32_t a0, int32_t a1, float ws, float s, const float* bias) {
  float y = static_cast<float>(a0) * ws;
  y = y + (static_cast<float>(a1) * ws) * RESIDUAL_STEP;
  y = y * s;
  return bias ? y + *bias : y;
}

inline __mmask16 tail_mask(int64_t remaining) {  // lanes of a 16-wide chunk that lie inside the row
  return remaining >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << remaining) - 1);
}

}  // namespace int8k
