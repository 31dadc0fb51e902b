// The small per-layer operations of a decode step, fused (see assistant/engine/native.py for why):
// RMSNorm, rotary embedding + KV-cache write, causal attention over paged KV slots, SwiGLU.
// fp32 only; every path of the model (prefill, decode, batched or not) calls these same functions,
// so a sequence's numbers never depend on what else is in the step.
#include <torch/extension.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "int8_common.h"
#include "native.h"
#include "pool.h"

namespace {

// The KV cache holds float32 or bfloat16 (engine.kv_dtype); both read as 16 floats at a time. bf16 is a float's
// upper half: widened exactly, and narrowed with round-to-nearest-even as torch's .to(torch.bfloat16) does.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void store_row(uint16_t* dst, const float* src, int64_t n) {  // n: a multiple of 16
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
}

// 16 vectors -> one vector whose lane c is the sum of a[c]'s lanes (a is clobbered). Pairs merge level by level:
// the even and the odd lanes of (a[2i], a[2i + 1]) side by side, added, so each level halves the vectors and
// keeps the lanes in order: 15 merges of 3 instructions for 16 sums, where 16 horizontal sums take ~8 each.
inline __m512 sum16(__m512 (&a)[16]) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int n = 16; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i)
      a[i] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * i], even, a[2 * i + 1]),
                           _mm512_permutex2var_ps(a[2 * i], odd, a[2 * i + 1]));
  return a[0];
}

#if !defined(__AVX512F__)
// The AVX2 build: lane c of ((v_c0 + v_c1) + (v_c2 + v_c3)) + ((v_c4 + v_c5) + (v_c6 + v_c7)) for 8 vectors, which is
// sum16's tree over the lanes of one half of each of its vectors (emulated, vpermt2ps goes lane by lane). The adds
// are the same IEEE adds of the same values, so the sums are sum16's to the bit.
inline __m256 tree8(const __m256 (&v)[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// One head's scores against 16 keys, as the AVX-512 loop below computes them: per key, lanes l and l + 8 of each
// 16-float vector of the head in ymm halves (the same multiply and fused multiply-adds per lane), then sum16's tree.
template <class E>
inline __m512 scores16(const float* qj, const E* const (&keys)[16], int64_t nv) {
  __m256 half[2];
  for (int g = 0; g < 2; ++g) {
    __m256 lo[8], hi[8];
    for (int c = 0; c < 8; ++c) {
      const E* k = keys[8 * g + c];
      lo[c] = _mm256_mul_ps(_mm256_loadu_ps(qj), load8(k));
      hi[c] = _mm256_mul_ps(_mm256_loadu_ps(qj + 8), load8(k + 8));
      for (int64_t v = 1; v < nv; ++v) {
        lo[c] = _mm256_fmadd_ps(_mm256_loadu_ps(qj + 16 * v), load8(k + 16 * v), lo[c]);
        hi[c] = _mm256_fmadd_ps(_mm256_loadu_ps(qj + 16 * v + 8), load8(k + 16 * v + 8), hi[c]);
      }
    }
    half[g] = _mm256_add_ps(tree8(lo), tree8(hi));
  }
  return avx2c::join(half[0], half[1]);
}
#endif

constexpr int64_t SEGMENT = 128;  // keys per work item of `attend` (a multiple of 16)

// o_j = sum_c p_j[c] v_c over `count` keys for n <= J query heads (p_j at p + j * stride) in one pass over the
// values: J accumulator sets of V vectors; n < J is dispatched to the template with J = n, so no accumulator set
// is ever skipped at run time (a skipped one sends the compiler to memory). V == 0: any head dim, one head a pass.
template <int V, int J, class E>
void weigh_heads(int64_t n, const float* p, int64_t stride, int64_t count, const E* vp, const int64_t* ctx_slots,
                 int64_t KVH, int64_t g, int64_t hd, float* out) {
  if constexpr (V == 0) {
    for (int64_t j = 0; j < n; ++j) {
      __m512 o[16];
      for (int64_t v = 0; v < hd / 16; ++v) o[v] = _mm512_setzero_ps();
      for (int64_t c = 0; c < count; ++c) {
        const E* val = vp + (ctx_slots[c] * KVH + g) * hd;
        const __m512 pc = _mm512_set1_ps(p[j * stride + c]);
        for (int64_t v = 0; v < hd / 16; ++v) o[v] = _mm512_fmadd_ps(pc, load16(val + 16 * v), o[v]);
      }
      for (int64_t v = 0; v < hd / 16; ++v) _mm512_storeu_ps(out + j * hd + 16 * v, o[v]);
    }
    return;
  } else {
    if constexpr (J > 1) {
      if (n < J) return weigh_heads<V, J - 1>(n, p, stride, count, vp, ctx_slots, KVH, g, hd, out);
    }
    __m512 o[J][V];
    for (int j = 0; j < J; ++j)
      for (int v = 0; v < V; ++v) o[j][v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < count; ++c) {
      const E* val = vp + (ctx_slots[c] * KVH + g) * (16 * V);
      __m512 vv[V];
      for (int v = 0; v < V; ++v) vv[v] = load16(val + 16 * v);
      for (int j = 0; j < J; ++j) {
        const __m512 pc = _mm512_set1_ps(p[j * stride + c]);
        for (int v = 0; v < V; ++v) o[j][v] = _mm512_fmadd_ps(pc, vv[v], o[j][v]);
      }
    }
    for (int j = 0; j < J; ++j)
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + j * 16 * V + 16 * v, o[j][v]);
  }
}

#if !defined(__AVX512F__)
// weigh_heads on the AVX2 build: the emulated 16-float accumulators went through general registers (SIMDe), much
// of an 8-row step's attention by perf. Here one head at a time, in passes of up to 64 of its floats (W8 ymm accumulators),
// each accumulator the same chain of fused multiply-adds over the keys in order as its lanes above: the same bits.
template <int W8, class E>
void weigh_columns(const float* pj, int64_t count, const E* vp, const int64_t* ctx_slots, int64_t KVH, int64_t g,
                   int64_t hd, int64_t col, float* out) {
  __m256 o[W8];
  for (int h = 0; h < W8; ++h) o[h] = _mm256_setzero_ps();
  for (int64_t c = 0; c < count; ++c) {
    const E* val = vp + (ctx_slots[c] * KVH + g) * hd + col;
    const __m256 pc = _mm256_set1_ps(pj[c]);
    for (int h = 0; h < W8; ++h) o[h] = _mm256_fmadd_ps(pc, load8(val + 8 * h), o[h]);
  }
  for (int h = 0; h < W8; ++h) _mm256_storeu_ps(out + col + 8 * h, o[h]);
}

template <class E>
void weigh_heads_ymm(int64_t n, const float* p, int64_t stride, int64_t count, const E* vp, const int64_t* ctx_slots,
                     int64_t KVH, int64_t g, int64_t hd, float* out) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t col = 0; col < hd; col += 64) {
      const float* pj = p + j * stride;
      float* oj = out + j * hd;
      switch (std::min<int64_t>(64, hd - col) / 16) {  // hd is a multiple of 16
        case 1: weigh_columns<2>(pj, count, vp, ctx_slots, KVH, g, hd, col, oj); break;
        case 2: weigh_columns<4>(pj, count, vp, ctx_slots, KVH, g, hd, col, oj); break;
        case 3: weigh_columns<6>(pj, count, vp, ctx_slots, KVH, g, hd, col, oj); break;
        default: weigh_columns<8>(pj, count, vp, ctx_slots, KVH, g, hd, col, oj); break;
      }
    }
}
#endif

// Where one work item of `attend` leaves its partial results: per (query row of its sequence, head), the segment's
// largest score m, l = sum_c exp(score_c - m), and o = sum_c exp(score_c - m) v_c (hd floats, not normalized).
struct Partials {
  float* o;
  float* m;
  float* l;
};

// Prefetches of the next keys' and values' cache lines, spread over a batch of passes (`issue` before each): a
// burst of a few hundred at once stalls on the core's outstanding misses, so the cache was read at ~12 GB/s, a
// third of a plain read. Spread, 16 sequences of 300 keys at 24 layers of the 0.5B (1 thread) took 6.0 ms
// against 9.5, and 1 row at 2,000 keys 2.2-2.4 ms against 3.0-3.4 (the same bits: only the loads' timing moves).
struct Ahead {
  const char* records[32];  // where each key's and value's part to read starts, `lines` cache lines each
  int64_t n = 0, lines = 1, share = 0, rec = 0, line = 0;
  void reset(int64_t record_lines) { n = 0, rec = 0, line = 0, lines = record_lines; }
  void add(const char* k, const char* v) { records[n++] = k, records[n++] = v; }
  void plan(int64_t passes) { share = (n * lines + passes - 1) / passes; }  // lines a pass, rounded up
  void issue() {
    for (int64_t i = 0; i < share && rec < n; ++i) {
      _mm_prefetch(records[rec] + 64 * line, _MM_HINT_T1);
      if (++line == lines) line = 0, ++rec;
    }
  }
};

// One work item of `attend`: keys s0 .. s0 + SEGMENT of one sequence (slots ctx_slots), for each of its `rows`
// query rows (q: rows x H x hd, pre-scaled) that sees any of them (row r sees its first vis[r] keys), every head.
// V = hd / 16 as a template argument (0: known only at run time) so that the loops over a head's vectors unroll.
//   scores: 16 keys at a time; each key's whole cache record (every kv head) is read once per item and feeds all
//           the rows and heads (L1), so the cache streams in order; the 16 dot products of a head are summed by
//           one merge tree (sum16); the next 16 keys' records (keys and values) are prefetched into L2 meanwhile,
//           a share before each head's pass (Ahead);
//   softmax: vectorized exp over the segment, 16 keys at a time;
//   values: 16 / V heads share each pass over the values (one value load feeds all of them).
template <int V, class E>
void attend_segment(const float* q, int64_t rows, const int64_t* vis, int64_t H, int64_t KVH, int64_t hd,
                    const E* kp, const E* vp, const int64_t* ctx_slots, int64_t s0, int64_t g0, int64_t g1,
                    std::vector<float>& p, const Partials& out) {
  const int64_t G = H / KVH, nv = V ? V : hd / 16, rec = KVH * hd;
  // the part of a key's record this item reads (its kv heads g0 .. g1), in whole cache lines
  const int64_t first = g0 * hd * static_cast<int64_t>(sizeof(E)) / 64;
  const int64_t lines = ((g1 * hd * static_cast<int64_t>(sizeof(E)) + 63) / 64) - first;
  auto limit = [&](int64_t r) { return std::min(vis[r], s0 + SEGMENT); };  // row r's keys end here
  int64_t end = s0;
  for (int64_t r = 0; r < rows; ++r) end = std::max(end, limit(r));
  p.resize(rows * H * SEGMENT);
  alignas(64) static const E zero_key[256] = {};  // stands in for the keys past a row's last
  const E* keys[16];
  Ahead ahead;
  for (int64_t c0 = s0; c0 < end; c0 += 16) {
    ahead.reset(lines);  // the next 16 keys and values, into L2, a share before each head's pass
    for (int64_t c = c0 + 16; c < std::min(c0 + 32, end); ++c)
      ahead.add(reinterpret_cast<const char*>(kp + ctx_slots[c] * rec) + 64 * first,
                reinterpret_cast<const char*>(vp + ctx_slots[c] * rec) + 64 * first);
    ahead.plan((g1 - g0) * G);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t rk = std::min<int64_t>(16, limit(r) - c0);
      if (rk <= 0) continue;
      for (int64_t g = g0; g < g1; ++g) {
        for (int c = 0; c < 16; ++c) keys[c] = c < rk ? kp + ctx_slots[c0 + c] * rec + g * hd : zero_key;
        for (int64_t j = g * G; j < (g + 1) * G; ++j) {
          ahead.issue();
          const float* qj = q + (r * H + j) * hd;
#if defined(__AVX512F__)
          __m512 acc[16];  // a fixed trip count with no early exit, so the 16 sums stay in registers
#pragma GCC unroll 16
          for (int c = 0; c < 16; ++c) {
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qj), load16(keys[c]));
            for (int64_t v = 1; v < nv; ++v) s = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * v), load16(keys[c] + 16 * v), s);
            acc[c] = s;
          }
          const __m512 scores = sum16(acc);
#else
          const __m512 scores = scores16(qj, keys, nv);
#endif
          _mm512_mask_storeu_ps(p.data() + (r * H + j) * SEGMENT + (c0 - s0), int8k::tail_mask(rk), scores);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t count = limit(r) - s0;
    if (count <= 0) continue;
    for (int64_t j = g0 * G; j < g1 * G; ++j) {
      float* pj = p.data() + (r * H + j) * SEGMENT;
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t c = 0; c < count; c += 16) {
        const __mmask16 tm = int8k::tail_mask(count - c);
        mx = _mm512_mask_max_ps(mx, tm, mx, _mm512_maskz_loadu_ps(tm, pj + c));
      }
      const float top = _mm512_reduce_max_ps(mx);
      const __m512 m = _mm512_set1_ps(top);
      __m512 total = _mm512_setzero_ps();
      for (int64_t c = 0; c < count; c += 16) {
        const __mmask16 tm = int8k::tail_mask(count - c);
        const __m512 e = _mm512_maskz_mov_ps(tm, int8k::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tm, pj + c), m)));
        _mm512_mask_storeu_ps(pj + c, tm, e);
        total = _mm512_add_ps(total, e);
      }
      out.m[r * H + j] = top;
      out.l[r * H + j] = _mm512_reduce_add_ps(total);
    }
#if defined(__AVX512F__)
    constexpr int J = V ? 16 / V : 1;
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t j0 = g * G; j0 < (g + 1) * G; j0 += J)
        weigh_heads<V, J>(std::min<int64_t>(J, (g + 1) * G - j0), p.data() + (r * H + j0) * SEGMENT, SEGMENT, count, vp,
                          ctx_slots + s0, KVH, g, hd, out.o + (r * H + j0) * hd);
#else
    for (int64_t g = g0; g < g1; ++g)
      weigh_heads_ymm(G, p.data() + (r * H + g * G) * SEGMENT, SEGMENT, count, vp, ctx_slots + s0, KVH, g, hd,
                      out.o + (r * H + g * G) * hd);
#endif
  }
}

}  // namespace

// x (T, D), w (D,) -> x * rsqrt(mean(x^2) + eps) * w
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  x = x.contiguous();
  const int64_t T = x.size(0), D = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int8k::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = xp + t * D;
      double ss = 0.0;
      for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(row[d]) * row[d];
      const float inv = 1.f / std::sqrt(static_cast<float>(ss / D) + static_cast<float>(eps));
      for (int64_t d = 0; d < D; ++d) op[t * D + d] = row[d] * inv * wp[d];
    }
  });
  return out;
}

// qkv (T, (H + 2 KVH) * hd) -> q (T, H, hd), rotated and multiplied by `q_scale`; the rotated keys and the
// values go to kc/vc (S, KVH, hd) at `slots` (T,). cos/sin (T, hd) in rotate_half layout, sin signed:
// rotated = x * cos + roll(x, hd / 2) * signed_sin.
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t H, int64_t KVH,
                         double q_scale, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots) {
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t T = qkv.size(0), hd = kc.size(2), half = hd / 2, width = qkv.size(1);
  TORCH_CHECK(width == (H + 2 * KVH) * hd, "rope_store: qkv width does not match the heads");
  TORCH_CHECK(hd % 16 == 0 && hd <= 256, "rope_store: head dim must be a multiple of 16, at most 256");
  auto q = torch::empty({T, H, hd}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  const float qs = static_cast<float>(q_scale);
  TORCH_CHECK(kc.dtype() == vc.dtype() && (kc.dtype() == torch::kFloat || kc.dtype() == torch::kBFloat16),
              "rope_store: the KV cache must be float32 or bfloat16");
  auto run = [&](auto* kp, auto* vp) {
    int8k::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
      float row[256];
      for (int64_t t = t0; t < t1; ++t) {
        const float* c = cp + t * hd;
        const float* s = sp + t * hd;
        for (int64_t h = 0; h < H + KVH; ++h) {
          const float* x = xp + t * width + h * hd;
          float* dst = h < H ? qp + (t * H + h) * hd : row;
          const float scale = h < H ? qs : 1.f;
          for (int64_t d = 0; d < hd; ++d) {
            const float rolled = x[d < half ? d + half : d - half];
            dst[d] = (x[d] * (c[d] * scale)) + (rolled * (s[d] * scale));
          }
          if (h >= H) store_row(kp + (slot[t] * KVH + (h - H)) * hd, row, hd);
        }
        store_row(vp + slot[t] * KVH * hd, xp + t * width + (H + KVH) * hd, KVH * hd);
      }
    });
  };
  if (kc.dtype() == torch::kBFloat16)
    run(reinterpret_cast<uint16_t*>(kc.data_ptr()), reinterpret_cast<uint16_t*>(vc.data_ptr()));
  else
    run(kc.data_ptr<float>(), vc.data_ptr<float>());
  return q;
}

// Causal attention of a step's queries over paged KV: q (T, H, hd), already scaled. Sequence b owns query
// rows q_off[b] .. q_off[b + 1] (its newest positions) and context slots slots[kv_off[b] .. kv_off[b + 1]];
// its j-th of n queries sees the first ctx - n + j + 1 of them (the cache already holds this step's keys).
//
// Design note. Decode attention is bound by reading the cache, and the cache holds each key's kv heads side by
// side. One work item per (query row, kv head), as before, read half of every key's record, at half the bytes per
// second of a sequential read (8.4 GB/s for one row at 2,000 keys of the 0.5B), and every query row of a sequence
// (speculated tokens) read the whole cache again. Now one work item is a SEGMENT of one sequence's keys: it
// reads each key's record once, in order, for all its query rows and heads, and leaves per (row, head) the
// segment's max score m_s, l_s = sum exp(score - m_s) and o_s = sum exp(score - m_s) v; the rows are then merged
// over their segments in order: M = max m_s, out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M). Segments
// start at fixed key positions and a row reads only the keys it sees, so a row's numbers never depend on the
// rest of the step (other sequences, or other rows of its own); with one segment (SEGMENT keys or fewer) they
// are the single-pass softmax exactly (e^0 = 1). With too few items for the threads (short contexts), each is
// split by kv head as well: the same numbers, each key's record then read once per kv head.
// Measured, 24 layers of the 0.5B's shapes at 2,000 keys, the old and new builds alternating, medians of 7 (cache
// blocks in order / shuffled): 1 row 3.6-3.8 -> 2.6-3.2 ms / 6.2 -> 3.4 ms; 4 rows of one sequence 7.5-9.1 ->
// 6.5-7.6 / 10.3-11.6 -> 7.4-9.2 ms; 8 sequences of one row 29-31 -> 26.6 / 35-40 -> 29 ms. At 300 keys a
// sequence's 4-8 rows cost 0.2-0.35 ms more a step (three segments balance worse over two threads than 8+ items).
torch::Tensor attend(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots, torch::Tensor kv_off,
                     torch::Tensor q_off) {
  q = q.contiguous();
  const int64_t T = q.size(0), H = q.size(1), hd = q.size(2), KVH = kc.size(1), G = H / KVH, B = kv_off.size(0) - 1;
  TORCH_CHECK(hd % 16 == 0 && hd <= 256, "attend: head dim must be a multiple of 16, at most 256");
  TORCH_CHECK(q_off.size(0) == B + 1, "attend: one query range per sequence");
  TORCH_CHECK(G * KVH == H, "attend: the query heads must split evenly over the kv heads");
  auto out = torch::empty_like(q);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* kvo = kv_off.data_ptr<int64_t>();
  const int64_t* qo = q_off.data_ptr<int64_t>();
  TORCH_CHECK(qo[B] == T, "attend: query ranges do not cover q");
  // every query row's visible keys; work items (sequence, first key) and where their partials go
  std::vector<int64_t> seq_of(T), vis(T);
  struct Item {
    int64_t b, s0, at;  // at: the item's first partial (row-major over its sequence's rows x heads)
    int64_t g0, g1;     // its kv heads
  };
  std::vector<Item> items;
  std::vector<int64_t> first_item(B);
  int64_t parts = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qo[b + 1] - qo[b], ctx = kvo[b + 1] - kvo[b];
    TORCH_CHECK(n <= ctx, "attend: a sequence has more queries than keys");
    for (int64_t t = qo[b]; t < qo[b + 1]; ++t) seq_of[t] = b, vis[t] = ctx - n + (t - qo[b]) + 1;
    first_item[b] = static_cast<int64_t>(items.size());
    for (int64_t s0 = 0; s0 < ctx; s0 += SEGMENT) items.push_back({b, s0, parts, 0, KVH}), parts += n * H;
  }
  // too few items to keep every thread busy (short contexts): one per kv head as well. A (row, head)'s numbers
  // are the same whichever item computes them; only the keys' records are then read once per kv head.
  int64_t per_segment = 1;  // items per segment
  if (KVH > 1 && static_cast<int64_t>(items.size()) < 2 * int8k::pool().threads()) {
    per_segment = KVH;
    std::vector<Item> split;
    for (const Item& it : items)
      for (int64_t g = 0; g < KVH; ++g) split.push_back({it.b, it.s0, it.at, g, g + 1});
    items.swap(split);
    for (int64_t b = 0; b < B; ++b) first_item[b] *= KVH;
  }
  // every partial a row merges is written by its item first: no zero fill (megabytes at long contexts)
  const std::unique_ptr<float[]> po(new float[parts * hd]), pm(new float[parts]), pl(new float[parts]);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t V = hd / 16;
  TORCH_CHECK(kc.dtype() == vc.dtype() && (kc.dtype() == torch::kFloat || kc.dtype() == torch::kBFloat16),
              "attend: the KV cache must be float32 or bfloat16");
  auto run = [&](const auto* kp, const auto* vp) {
    int8k::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
      thread_local std::vector<float> p;
      for (int64_t i = i0; i < i1; ++i) {
        const Item& it = items[i];
        const int64_t t0 = qo[it.b], n = qo[it.b + 1] - t0;
        const Partials part{po.get() + it.at * hd, pm.get() + it.at, pl.get() + it.at};
        auto segment = [&]<int N>() {
          attend_segment<N>(qp + t0 * H * hd, n, vis.data() + t0, H, KVH, hd, kp, vp, sl + kvo[it.b], it.s0, it.g0,
                            it.g1, p, part);
        };
        switch (V) {  // hd / 16 as a template argument where it is a common one
          case 2: segment.template operator()<2>(); break;
          case 4: segment.template operator()<4>(); break;
          case 8: segment.template operator()<8>(); break;
          case 16: segment.template operator()<16>(); break;
          default: segment.template operator()<0>(); break;
        }
      }
    });
  };
  if (kc.dtype() == torch::kBFloat16)
    run(reinterpret_cast<const uint16_t*>(kc.data_ptr()), reinterpret_cast<const uint16_t*>(vc.data_ptr()));
  else
    run(kc.data_ptr<float>(), vc.data_ptr<float>());
  // merge each row's segments, in order
  int8k::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = seq_of[t], r = t - qo[b];
      const int64_t segments = (vis[t] + SEGMENT - 1) / SEGMENT;
      for (int64_t j = 0; j < H; ++j) {
        auto at = [&](int64_t s) { return items[first_item[b] + s * per_segment].at + r * H + j; };
        float top = -INFINITY;
        for (int64_t s = 0; s < segments; ++s) top = std::max(top, pm[at(s)]);
        __m512 o[16];
        for (int64_t v = 0; v < V; ++v) o[v] = _mm512_setzero_ps();
        float total = 0.f;
        for (int64_t s = 0; s < segments; ++s) {
          const float w = _mm512_cvtss_f32(int8k::exp16(_mm512_set1_ps(pm[at(s)] - top)));
          total = total + pl[at(s)] * w;
          const float* os = po.get() + at(s) * hd;
          const __m512 wv = _mm512_set1_ps(w);
          for (int64_t v = 0; v < V; ++v) o[v] = _mm512_add_ps(o[v], _mm512_mul_ps(_mm512_loadu_ps(os + 16 * v), wv));
        }
        const __m512 inv = _mm512_set1_ps(1.f / total);
        float* dst = op + (t * H + j) * hd;
        for (int64_t v = 0; v < V; ++v) _mm512_storeu_ps(dst + 16 * v, _mm512_mul_ps(o[v], inv));
      }
    }
  });
  return out;
}

// gate_up (T, 2F) -> silu(gate) * up (T, F), silu(g) = g / (1 + exp(-g)).
torch::Tensor swiglu(torch::Tensor gu) {
  gu = gu.contiguous();
  const int64_t T = gu.size(0), F = gu.size(1) / 2;
  auto out = torch::empty({T, F}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int8k::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gp + t * 2 * F;
      const float* u = g + F;
      for (int64_t f = 0; f < F; f += 16) {
        const __mmask16 m = int8k::tail_mask(F - f);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + f);
        const __m512 e = int8k::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_mask_storeu_ps(op + t * F + f, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, u + f)));
      }
    }
  });
  return out;
}
