// The AVX-512 intrinsics of the native kernels, on a CPU with AVX2 and FMA only (most laptops and desktops: Intel's
// client cores since Alder Lake, AMD's before Zen 4). Empty when the build targets AVX-512.
//
// Why: the kernels (RMSNorm, RoPE with the KV write, paged attention, SwiGLU, the row quantization and epilogue, the
// screened lm_head, the decode stack) are written once, in 16-lane AVX-512. On an AVX2 CPU the engine used to run
// every layer op through PyTorch ops (~60% of a decode step, native.py), and got other numbers than an AVX-512
// machine for the same prompt. Built against this header the same sources run there: SIMDe (libsimde-dev, a
// maintained header library) maps each 512-bit intrinsic onto two 256-bit halves, and this header adds the ones
// SIMDe 0.7.4 lacks. Every emulation is lane for lane the same IEEE operation (FMA stays fused: -mfma), and the
// horizontal reductions follow GCC's own order (avx512fintrin.h `__MM512_REDUCE_OP`), so that a build here computes
// the same bits as the AVX-512 build (tests/test_engine_kernels.py compares the two builds on a CPU that runs both;
// the machine this was written on had no AVX-512, so that comparison has not run yet). The hot loops have AVX2
// bodies of their own where the emulation is slow (int8_common.h `dot_tile_ymm` and exp16's 2^n, lm_head.cpp's
// estimates and exact dots, layer_ops.cpp's attention, int8_linear.cpp `int_mm`; native.py has why and what they
// gained); on this build every kernel test of tests/test_engine_kernels.py runs against its references.
#pragma once
#include <immintrin.h>

#if !defined(__AVX512F__)
#if !defined(__AVX2__) || !defined(__FMA__)
#error "the AVX2 build of the native kernels needs -mavx2 -mfma"
#endif
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <climits>
#include <cstdint>
#include <cstring>

namespace avx2c {

struct F2 {
  __m256 lo, hi;
};
struct I2 {
  __m256i lo, hi;
};
inline F2 split(simde__m512 a) {
  const simde__m512_private p = simde__m512_to_private(a);
  return {p.m256[0], p.m256[1]};
}
inline I2 split(simde__m512i a) {
  const simde__m512i_private p = simde__m512i_to_private(a);
  return {p.m256i[0], p.m256i[1]};
}
inline simde__m512 join(__m256 lo, __m256 hi) {
  simde__m512_private p;
  p.m256[0] = lo, p.m256[1] = hi;
  return simde__m512_from_private(p);
}
inline simde__m512i join(__m256i lo, __m256i hi) {
  simde__m512i_private p;
  p.m256i[0] = lo, p.m256i[1] = hi;
  return simde__m512i_from_private(p);
}

// Lanes 0-7 (or 8-15 for `hi`) of a 16-bit mask as an all-ones / all-zeros vector per lane.
inline __m256i lanes(unsigned k, bool hi) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(hi ? k >> 8 : k), bit), bit);
}

inline simde__m512 cvtepi32_ps(simde__m512i a) {
  const I2 h = split(a);
  return join(_mm256_cvtepi32_ps(h.lo), _mm256_cvtepi32_ps(h.hi));
}
inline simde__m512i cvtepu16_epi32(__m256i a) {
  return join(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
// 16 int32 -> 16 int16, truncated (vpmovdw)
inline __m256i cvtepi32_epi16(simde__m512i a) {
  const I2 h = split(a);
  const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i lo = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(h.lo, pick), 0x08);
  const __m256i hi = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(h.hi, pick), 0x08);
  return _mm256_inserti128_si256(lo, _mm256_castsi256_si128(hi), 1);
}
inline float cvtss_f32(simde__m512 a) { return _mm256_cvtss_f32(split(a).lo); }

template <int IMM>
inline uint16_t mask_cmp_ps(unsigned k, simde__m512 a, simde__m512 b) {
  const F2 x = split(a), y = split(b);
  const unsigned lo = _mm256_movemask_ps(_mm256_cmp_ps(x.lo, y.lo, IMM));
  const unsigned hi = _mm256_movemask_ps(_mm256_cmp_ps(x.hi, y.hi, IMM));
  return static_cast<uint16_t>((lo | hi << 8) & k);
}

inline simde__m512 maskz_loadu_ps(unsigned k, const void* p) {
  const float* f = static_cast<const float*>(p);
  if ((k & 0xFFFF) == 0xFFFF) return join(_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8));
  return join(_mm256_maskload_ps(f, lanes(k, false)), _mm256_maskload_ps(f + 8, lanes(k, true)));
}
inline simde__m512 mask_loadu_ps(simde__m512 src, unsigned k, const void* p) {
  const F2 s = split(src), v = split(maskz_loadu_ps(k, p));
  return join(_mm256_blendv_ps(s.lo, v.lo, _mm256_castsi256_ps(lanes(k, false))),
              _mm256_blendv_ps(s.hi, v.hi, _mm256_castsi256_ps(lanes(k, true))));
}
inline simde__m512i maskz_loadu_epi32(unsigned k, const void* p) {
  const int* i = static_cast<const int*>(p);
  if ((k & 0xFFFF) == 0xFFFF) return join(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(i)),
                                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(i + 8)));
  return join(_mm256_maskload_epi32(i, lanes(k, false)), _mm256_maskload_epi32(i + 8, lanes(k, true)));
}
inline simde__m512i maskz_loadu_epi8(uint64_t k, const void* p) {
  alignas(64) uint8_t buf[64];
  if (k == ~0ull) {
    std::memcpy(buf, p, 64);
  } else {
    const uint8_t* b = static_cast<const uint8_t*>(p);
    for (int i = 0; i < 64; ++i) buf[i] = (k >> i) & 1 ? b[i] : 0;
  }
  return join(_mm256_load_si256(reinterpret_cast<const __m256i*>(buf)),
              _mm256_load_si256(reinterpret_cast<const __m256i*>(buf + 32)));
}
inline void mask_storeu_ps(void* p, unsigned k, simde__m512 a) {
  float* f = static_cast<float*>(p);
  const F2 h = split(a);
  if ((k & 0xFFFF) == 0xFFFF) {
    _mm256_storeu_ps(f, h.lo), _mm256_storeu_ps(f + 8, h.hi);
    return;
  }
  _mm256_maskstore_ps(f, lanes(k, false), h.lo);
  _mm256_maskstore_ps(f + 8, lanes(k, true), h.hi);
}
inline simde__m512i maskz_cvtps_epi32(unsigned k, simde__m512 a) {
  const F2 h = split(a);
  return join(_mm256_and_si256(_mm256_cvtps_epi32(h.lo), lanes(k, false)),
              _mm256_and_si256(_mm256_cvtps_epi32(h.hi), lanes(k, true)));
}
// the low byte of each int32 lane under the mask (vpmovdb: truncation)
inline void mask_cvtepi32_storeu_epi8(void* p, unsigned k, simde__m512i a) {
  alignas(32) int32_t v[16];
  const I2 h = split(a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(v), h.lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(v + 8), h.hi);
  int8_t* out = static_cast<int8_t*>(p);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) out[i] = static_cast<int8_t>(v[i]);
}

// GCC's order: the 256-bit halves (high op low), then the 128-bit halves, then lanes {2, 3, 0, 1}, then 0 op 1.
inline int reduce_add_epi32(simde__m512i a) {
  const I2 h = split(a);
  const __m256i t3 = _mm256_add_epi32(h.hi, h.lo);
  const __m128i t6 = _mm_add_epi32(_mm256_extracti128_si256(t3, 1), _mm256_castsi256_si128(t3));
  const __m128i t8 = _mm_add_epi32(t6, _mm_shuffle_epi32(t6, 0x4E));
  return _mm_cvtsi128_si32(t8) + _mm_extract_epi32(t8, 1);
}
inline int mask_reduce_min_epi32(unsigned k, simde__m512i a) {
  const I2 h = split(a);
  const __m256i big = _mm256_set1_epi32(INT_MAX);
  const __m256i lo = _mm256_blendv_epi8(big, h.lo, lanes(k, false)), hi = _mm256_blendv_epi8(big, h.hi, lanes(k, true));
  const __m256i t3 = _mm256_min_epi32(hi, lo);
  const __m128i t6 = _mm_min_epi32(_mm256_extracti128_si256(t3, 1), _mm256_castsi256_si128(t3));
  const __m128i t8 = _mm_min_epi32(t6, _mm_shuffle_epi32(t6, 0x4E));
  return std::min(_mm_cvtsi128_si32(t8), _mm_extract_epi32(t8, 1));
}
inline float reduce_add_ps(simde__m512 a) {
  const F2 h = split(a);
  const __m256 t3 = _mm256_add_ps(h.hi, h.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, 0x4E));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 0x55));
}
inline float reduce_max_ps(simde__m512 a) {
  const F2 h = split(a);
  const __m256 t3 = _mm256_max_ps(h.hi, h.lo);
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, 0x4E));
  return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, 0x11)));
}
template <int IMM>
inline simde__m512i srai_epi32(simde__m512i a) {
  const I2 h = split(a);
  return join(_mm256_srai_epi32(h.lo, IMM), _mm256_srai_epi32(h.hi, IMM));
}

}  // namespace avx2c

#define _mm512_cvtepi32_ps(a) avx2c::cvtepi32_ps(a)
#define _mm512_cvtepu16_epi32(a) avx2c::cvtepu16_epi32(a)
#define _mm512_cvtepi32_epi16(a) avx2c::cvtepi32_epi16(a)
#define _mm512_cvtss_f32(a) avx2c::cvtss_f32(a)
#define _mm512_mask_cmp_ps_mask(k, a, b, imm) avx2c::mask_cmp_ps<(imm)>((k), (a), (b))
#define _mm512_maskz_loadu_ps(k, p) avx2c::maskz_loadu_ps((k), (p))
#define _mm512_mask_loadu_ps(src, k, p) avx2c::mask_loadu_ps((src), (k), (p))
#define _mm512_maskz_loadu_epi32(k, p) avx2c::maskz_loadu_epi32((k), (p))
#define _mm512_maskz_loadu_epi8(k, p) avx2c::maskz_loadu_epi8((k), (p))
#define _mm512_mask_storeu_ps(p, k, a) avx2c::mask_storeu_ps((p), (k), (a))
#define _mm512_maskz_cvtps_epi32(k, a) avx2c::maskz_cvtps_epi32((k), (a))
#define _mm512_mask_cvtepi32_storeu_epi8(p, k, a) avx2c::mask_cvtepi32_storeu_epi8((p), (k), (a))
#define _mm512_reduce_add_epi32(a) avx2c::reduce_add_epi32(a)
#define _mm512_mask_reduce_min_epi32(k, a) avx2c::mask_reduce_min_epi32((k), (a))
#define _mm512_reduce_add_ps(a) avx2c::reduce_add_ps(a)
#define _mm512_reduce_max_ps(a) avx2c::reduce_max_ps(a)
#define _mm512_srai_epi32(a, imm) avx2c::srai_epi32<(imm)>(a)
#endif
