// Shared by the native kernels (csrc/*.cpp): the row quantization and the float epilogue that every int8 path
// uses, so that a row's output never depends on the kernel that computed it; a vectorized exp.
#pragma once
#include <immintrin.h>

#include "avx512_on_avx2.h"  // empty in the AVX-512 build

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace int8k {

constexpr int64_t BLOCK = 64;    // outputs per packed block: 4 zmm accumulators of 16 int32
constexpr int64_t MAX_ROWS = 32;  // GEMM rows one `linear` call takes (activation + residual rows)
constexpr int TILE_ROWS = 6;      // rows per pass over a block: 6 x 4 accumulators + 4 weight vectors fit in 32 zmm
constexpr float RESIDUAL_STEP = 1.f / 254.f;

inline __mmask16 tail_mask(int64_t remaining) {  // lanes of a 16-wide chunk that lie inside the row
  return remaining >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << remaining) - 1);
}

struct RowSums {  // sums of a quantized row's bytes (the +128 weights' correction is 128 times them)
  int32_t q, r;
};

// Per-row quantization into s8 (q) and the residual at 1/254 of the step (r, when r_out is given), 16 lanes at
// a time: x / s, round half to even, (u - q) * 254, round: the same IEEE operations as one element at a time.
inline RowSums quantize_row(const float* x, int64_t K, float* scale_out, int8_t* q_out, int8_t* r_out) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail_mask(K - k), x + k)));
  const float s = std::max(_mm512_reduce_max_ps(amax), 1e-8f) / 127.f;
  *scale_out = s;
  const __m512 sv = _mm512_set1_ps(s), step = _mm512_set1_ps(254.f);
  constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512i sq = _mm512_setzero_si512(), sr = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = tail_mask(K - k);
    const __m512 u = _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + k), sv);
    const __m512 q = _mm512_roundscale_ps(u, NEAREST);
    const __m512i qi = _mm512_maskz_cvtps_epi32(m, q);
    _mm512_mask_cvtepi32_storeu_epi8(q_out + k, m, qi);
    sq = _mm512_add_epi32(sq, qi);
    if (r_out) {
      const __m512i ri = _mm512_maskz_cvtps_epi32(m, _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(u, q), step), NEAREST));
      _mm512_mask_cvtepi32_storeu_epi8(r_out + k, m, ri);
      sr = _mm512_add_epi32(sr, ri);
    }
  }
  return {_mm512_reduce_add_epi32(sq), _mm512_reduce_add_epi32(sr)};
}

// A generated row's outlier channels (int8.py `Linear.outliers`): the n largest |x| of the row, in ascending index
// order, kept in fp32 and left out of its int8 quantization.
constexpr int MAX_OUTLIERS = 32;
struct Outliers {
  int n = 0;
  int32_t idx[MAX_OUTLIERS];
  float val[MAX_OUTLIERS];
};

// The min(m, K) largest |x| of a row (ties: the lower index; NaN never), then sorted by index, and the row with them
// zeroed in `rest`. One vector compare per 16 inputs against the current m-th largest; only a lane above it is
// inserted by hand (a few dozen of a row's thousands).
inline void take_outliers(const float* x, int64_t K, int m, Outliers* out, float* rest) {
  m = static_cast<int>(std::min<int64_t>(m, K));
  float top[MAX_OUTLIERS];
  int n = 0;
  float floor = -1.f;  // |x| a lane must exceed to enter (the m-th largest once m are in)
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 tm = tail_mask(K - k);
    const __m512 v = _mm512_abs_ps(_mm512_maskz_loadu_ps(tm, x + k));
    _mm512_mask_storeu_ps(rest + k, tm, _mm512_maskz_loadu_ps(tm, x + k));
    uint32_t hits = _mm512_mask_cmp_ps_mask(tm, v, _mm512_set1_ps(floor), _CMP_GT_OQ);
    while (hits) {
      const int lane = __builtin_ctz(hits);
      hits &= hits - 1;
      const float a = std::fabs(x[k + lane]);
      if (!(a > floor)) continue;  // the floor rose since the compare
      int p = n < m ? n++ : m - 1;  // the slot it takes: a new one, or the smallest's
      while (p > 0 && a > top[p - 1]) {  // strictly larger moves up: an equal earlier index stays ahead
        top[p] = top[p - 1];
        out->idx[p] = out->idx[p - 1];
        --p;
      }
      top[p] = a;
      out->idx[p] = static_cast<int32_t>(k + lane);
      if (n == m) floor = top[m - 1];
    }
  }
  std::sort(out->idx, out->idx + n);
  for (int i = 0; i < n; ++i) {
    out->val[i] = x[out->idx[i]];
    rest[out->idx[i]] = 0.f;
  }
  out->n = n;
}

// sum_i val_i * w[col][idx_i] for the 16 outputs of word lane group j (0..3) of one VNNI block (w + 128 as u8,
// (K4, 64, 4) bytes: input k of output o at (k / 4) * 256 + o * 4 + k % 4), in the outliers' order.
inline __m512 outlier_sums16(const uint8_t* block, const Outliers& o, int j) {
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < o.n; ++i) {
    const int32_t k = o.idx[i];
    const __m512i words = _mm512_loadu_si512(block + (k / 4) * 256 + 64 * j);
    const __m512i w = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(words, 8 * (k % 4)), _mm512_set1_epi32(0xFF)),
                                       _mm512_set1_epi32(128));
    sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_cvtepi32_ps(w), _mm512_set1_ps(o.val[i])));
  }
  return sum;
}

// y[0:16] for one row from int32 accumulators (a1 == nullptr: one-pass row; outl: the row's outlier sums, or null).
inline __m512 epilogue16(__m512i a0, const __m512i* a1, __m512 ws, __m512 s, const float* bias, __mmask16 m,
                         const __m512* outl = nullptr) {
  __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(a0), ws);
  if (a1) y = _mm512_add_ps(y, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(*a1), ws), _mm512_set1_ps(RESIDUAL_STEP)));
  y = _mm512_mul_ps(y, s);
  if (outl) y = _mm512_add_ps(y, _mm512_mul_ps(*outl, ws));
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
#if defined(__AVX512F__)
  return _mm512_scalef_ps(p, n);
#else
  // SIMDe emulates vscalefps lane by lane through exp2f (a tenth of an 8-row step went there). n is a whole number
  // in [-126, 128] (x is clamped), p is near 1, so p * 2^n is two products by normal powers of two, 2^floor(n / 2)
  // and 2^(n - floor(n / 2)), both exact: the same value vscalefps gives.
  auto scale = [](__m256 p, __m256 n) {
    const __m256i ni = _mm256_cvtps_epi32(n), a = _mm256_srai_epi32(ni, 1), b = _mm256_sub_epi32(ni, a);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 pa = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(a, bias), 23));
    const __m256 pb = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, pa), pb);
  };
  const avx2c::F2 ps = avx2c::split(p), ns = avx2c::split(n);
  return avx2c::join(scale(ps.lo, ns.lo), scale(ps.hi, ns.hi));
#endif
}

// acc[r][j] += w_j . x_r over the words kg in [0, n) of R <= TILE_ROWS rows: `load(kg, w)` gives the kg-th four
// vectors of 64 outputs x 4 inputs as *unsigned* bytes (weights + 128, or the head's nibbles); the activations
// are signed bytes, 4 to an int32 word, row r's words at x + r * xs, broadcast as vpdpbusd's memory operand (no
// register of its own). Every register-resident accumulator stays exact int32 (|sum| < 2^31 for K < 2^14).
constexpr int BIASED = 0;   // dot_tile's unsigned bytes: weights + 128 (int8_linear.cpp)
constexpr int NIBBLES = 1;  // ... the head's nibbles: vectors 0 and 2 low (0-15), 1 and 3 high, 16x (lm_head.cpp)

#if defined(__AVX512F__)
template <int R, int KIND = BIASED, class Load>
inline void dot_tile(const Load& load, const int32_t* x, int64_t xs, int64_t n, __m512i (&acc)[R][4]) {
  static_assert(R >= 1 && R <= TILE_ROWS, "dot_tile: at most TILE_ROWS rows");
  for (int64_t kg = 0; kg < n; ++kg) {
    __m512i w[4];
    load(kg, w);
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(x[r * xs + kg]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], w[j], xv);
    }
  }
}

#else
// AVX2 (avx512_on_avx2.h): the same int32 sums without vpdpbusd, whose emulation widens every byte, and with
// accumulators in ymm registers of the tile's own (kept as emulated __m512i, GCC spilled them and stored each twice
// per multiply-add: an 8-row step's linears 59.9 -> 44.5 ms, its 16-row ones 116 -> 84 in one A/B). vpmaddubsw
// multiplies unsigned by signed bytes into int16 pair sums with saturation, so each kind of weight byte gets a form
// whose pair sums stay below 32,767 (activations are in [-127, 127]): BIASED, the signed weight (w + 128 xor 0x80)
// with the activation's sign (vpsignb) against |x|: 2 * 127 * 127; NIBBLES, a low nibble as it is, a high one
// shifted down and its pair sums widened with 16 instead of 1: 2 * 15 * 127. BIASED sums are w . x; a caller that
// wants vpdpbusd's (w + 128) . x starts the accumulators from 128 sum(x) (`init`).
//
// acc[r * acc_stride + o] (o < 64) for rows r < R: started from init[r] in every lane (init given) or read from acc,
// and written back after words [0, n). `load(kg, w)` gives the kg-th 8 vectors of 64 outputs x 4 inputs as unsigned
// bytes (BIASED: w + 128; NIBBLES: vectors 0-1 and 4-5 low nibbles, 2-3 and 6-7 high ones 16x, as the AVX-512 path).
template <int R, int KIND = BIASED, class Load>
inline void dot_tile_ymm(const Load& load, const int32_t* x, int64_t xs, int64_t n, int32_t* acc, int64_t acc_stride,
                         const int32_t* init) {
  static_assert(R >= 1 && R <= TILE_ROWS, "dot_tile_ymm: at most TILE_ROWS rows");
  const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i a[R][8];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 8; ++h)
      a[r][h] = init ? _mm256_set1_epi32(init[r])
                     : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + r * acc_stride + 8 * h));
  for (int64_t kg = 0; kg < n; ++kg) {
    __m256i w[8];
    load(kg, w);
    for (int h = 0; h < 8; ++h) {
      if constexpr (KIND == BIASED) w[h] = _mm256_xor_si256(w[h], flip);
      else if ((h / 2) & 1) w[h] = _mm256_srli_epi16(w[h], 4);  // 16 n in a byte whose low nibble is 0: n
    }
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_set1_epi32(x[r * xs + kg]);
      if constexpr (KIND == BIASED) {
        const __m256i ax = _mm256_abs_epi8(xv);
        for (int h = 0; h < 8; ++h)
          a[r][h] = _mm256_add_epi32(a[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w[h], xv)), ones));
      } else {
        for (int h = 0; h < 8; ++h)
          a[r][h] = _mm256_add_epi32(a[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(w[h], xv), (h / 2) & 1 ? sixteen : ones));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 8; ++h) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * acc_stride + 8 * h), a[r][h]);
}
#endif

// Calls f.template operator()<R>() for the run-time R in [1, TILE_ROWS] (the tile kernels are templates on R).
template <class F>
inline void dispatch_rows(int64_t R, F&& f) {
  switch (R) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    default: break;
  }
}

// Splits `total` rows into the fewest tiles of at most TILE_ROWS rows, as even as they go (8 rows: 4 + 4, not
// 6 + 2: a thin tile pays the weight loads of a full one), calling f(first row, rows) for each.
template <class F>
inline void for_each_tile(int64_t total, F&& f) {
  const int64_t tiles = (total + TILE_ROWS - 1) / TILE_ROWS;
  for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
    const int64_t rows = total / tiles + (t < total % tiles);
    f(r0, rows);
    r0 += rows;
  }
}


}  // namespace int8k
