// Shared by the native kernels (csrc/*.cpp): the row quantization and the float epilogue that every int8 path
// uses, so that a row's output never depends on the kernel that computed it; a vectorized exp.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace int8k {

constexpr int64_t BLOCK = 64;    // outputs per packed block: 4 zmm accumulators of 16 int32
constexpr int64_t MAX_ROWS = 16;  // GEMM rows one `linear` call takes (activation + residual rows)
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

// exp(x) for 16 floats: x = n ln2 + r, |r| <= ln2 / 2, degree-7 Taylor polynomial (relative error < 2e-7), times 2^n.
// Inputs are clamped to [-87.3, 88.7] so the result stays finite and positive.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2 split in two: exact n * hi
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t remaining) {  // lanes of a 16-wide chunk that lie inside the row
  return remaining >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << remaining) - 1);
}

}  // namespace int8k
