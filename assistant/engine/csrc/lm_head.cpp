// The lm_head of greedy rows, screened: the next token of a greedy step without streaming the whole
// int8 head (see assistant/engine/native.py and int8.py `Linear.greedy_logits` for the measurements).
//
// Design note. The head (vocab x dim, 136 MB of int8 for Qwen2.5-0.5B) is a quarter of the bytes a decode
// step reads, and a greedy step needs only its argmax. Each int8 weight splits exactly into nibbles:
//   w = 16 h + l,  h = w >> 4 in [-8, 7],  l = w & 15 in [0, 15].
// `head_pack` stores h as a second, 4-bit copy of the head in the VNNI block layout (half the bytes).
// A greedy row then
//   1. quantizes x exactly as `linear` does (q, residual r, scale s);
//   2. streams the 4-bit copy once: H_v = q . h_v (exact int32), the estimate
//        a0_v ~ 16 H_v + mean(l_v) * sum(q),   error e_v = q . (l_v - mean(l_v));
//   3. keeps every token whose estimate could still be the maximum: with sigma_v = |q|_2 * std(l_v) (the
//      error's standard deviation if the low nibbles are uncorrelated with q), token v is a candidate when
//        ws_v (est_v + Z sigma_v)  >=  max_u ws_u (est_u - Z sigma_u);
//      While streaming, each chunk of the vocabulary keeps per row only the tokens whose upper bound reaches
//      the largest lower bound seen so far (its own, and those of the chunks merged before it started: a
//      superset, since that bound never exceeds the row's final one), with their estimates; the chunks merge
//      under a lock, and once every bound is in, the candidates are filtered against the final one. No estimate is stored for
//      the whole vocabulary (a 16-row step wrote, re-read and rewrote 9.7 MB, and scanned it on one thread:
//      ~0.2 ms a row);
//   4. computes the candidates' logits exactly from the row-major int8 head (a0, a1 over q and r, the same
//      epilogue as `linear`, bit for bit) and writes -inf for every other token.
// In the stream, the odd vectors of a word group (the high nibble of each byte) are masked, not shifted: they
// multiply as 16 (h + 8), and their sums are shifted back exactly (one vector op less per vector).
// The argmax equals the full head's unless the winner's and a runner-up's errors together pass 2 Z sigma
// (Z = 8: a 16-sigma gap, beyond any probability that matters under that model; measured on real rows of
// Qwen2.5-0.5B, the largest |e_v| / sigma_v was 5.4 over ~5e7 token-rows). Ties resolve to the lowest
// index in both. Rows that sample use the full head.
#include <torch/extension.h>
#include <immintrin.h>

#include <cstring>
#include <mutex>
#include <vector>

#include "int8_common.h"
#include "native.h"
#include "pool.h"

namespace {

using int8k::BLOCK;
using int8k::quantize_row;
using int8k::tail_mask;

constexpr int64_t NIBBLE_BYTES = 128;  // one (64 outputs x 4 inputs) group of 4-bit weights
constexpr int64_t PREFETCH = 4096;
constexpr int64_t CHUNK = 32;  // K words per chunk when a block takes several tiles: 4 KB of nibbles

struct Screen {  // the per-output data of the 4-bit copy
  const uint8_t* packed;  // h + 8 in [0, 15], two to a byte, VNNI block layout
  const float* mean;      // mean(l_v)
  const float* ws;        // the int8 head's channel scales
  const float* margin;    // std(l_v) * ws_v
  int64_t K4, N;
};

// (h + 8) . q for rows r0 .. r0 + R over K words [k0, k0 + n) of one block of 64 outputs (w: the block's nibbles;
// the nibbles are vpdpbusd's unsigned operand, the activations its signed one, as in int8_linear.cpp):
// accumulators read from and written back to acc (zeroed when k0 == 0). As in int8_linear.cpp, rows past one
// tile run the block's K in chunks, every tile over a chunk while it is in L1; here tile `tile` of `tiles`
// prefetches every tiles-th word group ahead: the memory stream then flows under every tile's multiply-adds
// instead of stopping while the later tiles of a block compute (native.py has the figures). int8_linear.cpp's
// tiles now all prefetch every group; here that was slower (2026-11-30, 12 rows 2.7-2.8 -> 5.1-5.2 ms, 16 rows
// 4.0 -> 4.7-4.8, 8 rows 2.0 -> 1.9), so the head keeps its split.
template <int R>
void screen_chunk(const uint8_t* w, const int32_t* xb, int64_t K4, int64_t k0, int64_t n, int tile, int tiles,
                  int32_t* acc) {
  const uint8_t* base = w + k0 * NIBBLE_BYTES;
  int64_t next = tile;  // this tile prefetches every tiles-th word group of the stream ahead
  auto prefetch = [&](int64_t kg, const uint8_t* p) {
    if (kg == next) {
      _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH + 64), _MM_HINT_T1);
      next += tiles;
    }
  };
#if defined(__AVX512F__)
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i a[R][4];  // local, so the accumulators stay in registers through the loop
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = k0 ? _mm512_loadu_si512(acc + r * BLOCK + 16 * j) : _mm512_setzero_si512();
  int8k::dot_tile<R, int8k::NIBBLES>([&](int64_t kg, __m512i (&v)[4]) {
    const uint8_t* p = base + kg * NIBBLE_BYTES;
    prefetch(kg, p);
    const __m512i v0 = _mm512_loadu_si512(p), v1 = _mm512_loadu_si512(p + 64);
    v[0] = _mm512_and_si512(v0, low), v[1] = _mm512_andnot_si512(low, v0);  // the high nibbles stay 16x
    v[2] = _mm512_and_si512(v1, low), v[3] = _mm512_andnot_si512(low, v1);
  }, xb + k0, K4, n, a);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_si512(acc + r * BLOCK + 16 * j, a[r][j]);
#else
  static constexpr int32_t zeros[int8k::TILE_ROWS] = {};
  const __m256i low = _mm256_set1_epi8(0x0F);
  int8k::dot_tile_ymm<R, int8k::NIBBLES>([&](int64_t kg, __m256i (&v)[8]) {
    const uint8_t* p = base + kg * NIBBLE_BYTES;
    prefetch(kg, p);
    for (int half = 0; half < 2; ++half)  // the same vectors as above, each zmm as two ymm
      for (int i = 0; i < 2; ++i) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * half + 32 * i));
        v[4 * half + i] = _mm256_and_si256(b, low), v[4 * half + 2 + i] = _mm256_andnot_si256(low, b);
      }
  }, xb + k0, K4, n, acc, BLOCK, k0 ? nullptr : zeros);
#endif
}

// One row's candidates so far (of one chunk of the vocabulary, or merged): token ids with their estimates
// est_v * ws_v, and the largest lower bound ws_u (est_u - zq sigma_u) seen (at most the row's final floor, so it
// keeps a superset of the final candidates; head_greedy filters them once every bound is in).
struct Found {
  std::vector<int32_t> v;
  std::vector<float> est;
  float floor = -INFINITY;
};

// Rows r0 .. r0 + R of one block b from their accumulators (acc, BLOCK per row): each row's estimates, its lower
// bounds max-combined into found[r].floor, and the outputs whose upper bound ws_v (est_v + zq sigma_v) reaches
// that floor appended to found[r] (a few per row once the floor has risen past the first block).
template <int R>
void estimate(const Screen& sc, const int32_t* acc, const float* sum_q, const float* zq, Found* found, int64_t b) {
#if !defined(__AVX512F__)
  // The AVX2 build: the same IEEE operations, 8 outputs at a time (SIMDe's emulated masked loads and compress-stores
  // made this ~5% of an 8-row step); the kept outputs are appended in ascending order, as the compress-store does.
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int r = 0; r < R; ++r) {
    __m256 est[8], lo_r = _mm256_set1_ps(-INFINITY);
    __m256i ms[8];
    int parts = 0;
    for (; parts < 8; ++parts) {
      const int64_t col = b * BLOCK + 8 * parts;
      if (col >= sc.N) break;
      const __m256i m = ms[parts] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(8, sc.N - col))), lane);
      __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + r * BLOCK + 8 * parts));
      if ((parts / 2) & 1) a = _mm256_srai_epi32(a, 4);  // screen_chunk left the odd vectors' nibbles 16x: exact
      const __m256i h = _mm256_sub_epi32(a, _mm256_set1_epi32(8 * static_cast<int32_t>(sum_q[r])));
      est[parts] = _mm256_mul_ps(
          _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(h), _mm256_set1_ps(16.f)),
                        _mm256_mul_ps(_mm256_maskload_ps(sc.mean + col, m), _mm256_set1_ps(sum_q[r]))),
          _mm256_maskload_ps(sc.ws + col, m));
      const __m256 lo = _mm256_sub_ps(est[parts], _mm256_mul_ps(_mm256_set1_ps(zq[r]), _mm256_maskload_ps(sc.margin + col, m)));
      lo_r = _mm256_blendv_ps(lo_r, _mm256_max_ps(lo_r, lo), _mm256_castsi256_ps(m));
    }
    Found& f = found[r];
    f.floor = std::max(f.floor, _mm512_reduce_max_ps(avx2c::join(lo_r, _mm256_set1_ps(-INFINITY))));
    const __m256 fv = _mm256_set1_ps(f.floor), zv = _mm256_set1_ps(zq[r]);
    for (int i = 0; i < parts; ++i) {
      const int64_t col = b * BLOCK + 8 * i;
      const __m256 up = _mm256_add_ps(est[i], _mm256_mul_ps(zv, _mm256_maskload_ps(sc.margin + col, ms[i])));
      unsigned keep = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(up, fv, _CMP_GE_OQ), _mm256_castsi256_ps(ms[i])));
      if (!keep) continue;
      alignas(32) float e[8];
      _mm256_store_ps(e, est[i]);
      for (; keep; keep &= keep - 1) {
        const int l = __builtin_ctz(keep);
        f.v.push_back(static_cast<int32_t>(col + l));
        f.est.push_back(e[l]);
      }
    }
  }
#else
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int r = 0; r < R; ++r) {
    __m512 est[4], lo_r = _mm512_set1_ps(-INFINITY);
    __mmask16 ms[4] = {0, 0, 0, 0};
    for (int j = 0; j < 4; ++j) {
      const int64_t col = b * BLOCK + 16 * j;
      if (col >= sc.N) break;
      const __mmask16 m = ms[j] = tail_mask(sc.N - col);
      // H = acc - 8 sum(q);  est = 16 H + mean(l) sum(q)
      __m512i a = _mm512_loadu_si512(acc + r * BLOCK + 16 * j);
      if (j & 1) a = _mm512_srai_epi32(a, 4);  // screen_chunk left the odd vectors' nibbles 16x: exact
      const __m512i h = _mm512_sub_epi32(a, _mm512_set1_epi32(8 * static_cast<int32_t>(sum_q[r])));
      est[j] = _mm512_mul_ps(
          _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(h), _mm512_set1_ps(16.f)),
                        _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sc.mean + col), _mm512_set1_ps(sum_q[r]))),
          _mm512_maskz_loadu_ps(m, sc.ws + col));
      const __m512 lo = _mm512_sub_ps(est[j], _mm512_mul_ps(_mm512_set1_ps(zq[r]), _mm512_maskz_loadu_ps(m, sc.margin + col)));
      lo_r = _mm512_mask_max_ps(lo_r, m, lo_r, lo);
    }
    Found& f = found[r];
    f.floor = std::max(f.floor, _mm512_reduce_max_ps(lo_r));
    const __m512 fv = _mm512_set1_ps(f.floor), zv = _mm512_set1_ps(zq[r]);
    for (int j = 0; j < 4 && ms[j]; ++j) {
      const int64_t col = b * BLOCK + 16 * j;
      const __m512 up = _mm512_add_ps(est[j], _mm512_mul_ps(zv, _mm512_maskz_loadu_ps(ms[j], sc.margin + col)));
      const __mmask16 keep = _mm512_mask_cmp_ps_mask(ms[j], up, fv, _CMP_GE_OQ);
      if (!keep) continue;
      const size_t at = f.v.size();
      f.v.resize(at + 16), f.est.resize(at + 16);
      const __m512i ids = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(col)), lane);
      _mm512_mask_compressstoreu_epi32(f.v.data() + at, keep, ids);
      _mm512_mask_compressstoreu_ps(f.est.data() + at, keep, est[j]);
      f.v.resize(at + __builtin_popcount(keep)), f.est.resize(at + __builtin_popcount(keep));
    }
  }
#endif
}

// Exact (w + 128) . q - 128 sum(q) = w . q for one row-major int8 weight row (q: signed, zero-padded to 64).
inline int32_t dot_row(const int8_t* w, const int8_t* q, int64_t K, int32_t corr) {
#if defined(__AVX512F__)
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 m = K - k >= 64 ? ~0ULL : (1ULL << (K - k)) - 1;
    acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, w + k), flip), _mm512_maskz_loadu_epi8(m, q + k));
  }
  return _mm512_reduce_add_epi32(acc) - corr;
#else  // w . q directly, |q| against w with q's sign (int8_common.h dot_tile_ymm says why it is exact)
  (void)corr;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(qv), _mm256_sign_epi8(wv, qv)), ones));
  }
  int32_t t = _mm512_reduce_add_epi32(avx2c::join(acc, _mm256_setzero_si256()));  // integers: any order is exact
  for (; k < K; ++k) t += static_cast<int32_t>(w[k]) * q[k];
  return t;
#endif
}

}  // namespace

// int8 (N, K) head -> the 4-bit high nibbles + 8 in the VNNI block layout (blocks, K4, 128) u8, and per output
// the mean and standard deviation of the low nibbles.
std::vector<torch::Tensor> head_pack(torch::Tensor w) {
  auto padded = pad_weights(w);
  const int64_t Np = padded.size(0), Kp = padded.size(1);
  auto u = (padded.__rshift__(4) + 8).to(torch::kUInt8);  // h + 8 in [0, 15]
  auto v = u.view({Np / BLOCK, 4, 16, Kp / 4, 4}).permute({0, 3, 1, 2, 4}).reshape({Np / BLOCK, Kp / 4, 4, 64});
  using torch::indexing::Slice;
  auto lo = v.index({Slice(), Slice(), Slice(0, 4, 2)}), hi = v.index({Slice(), Slice(), Slice(1, 4, 2)});
  auto packed = lo.bitwise_or(hi.__lshift__(4)).reshape({Np / BLOCK, Kp / 4, NIBBLE_BYTES}).contiguous();
  auto l = w.bitwise_and(15).to(torch::kFloat);
  return {packed, l.mean(1).contiguous(), l.std(1, /*unbiased=*/false).contiguous()};
}

// Greedy rows of the head: x fp32 (n, K) -> (n, N) with the exact `linear` logits (two-pass rows) of every
// candidate and -inf elsewhere; also the number of candidates per row (the bench reports them).
// margin (N,) = std(l_v) * ws_v; z: the candidate margin in standard deviations.
std::vector<torch::Tensor> head_greedy(torch::Tensor x, torch::Tensor packed, torch::Tensor mean, torch::Tensor margin,
                                       torch::Tensor weight, torch::Tensor ws, c10::optional<torch::Tensor> bias,
                                       double z) {
  x = x.contiguous();
  const int64_t n = x.size(0), K = x.size(1), K4 = packed.size(1), N = weight.size(0), Kx = (K + 63) / 64 * 64;
  TORCH_CHECK(K4 * 4 >= K && K4 * 4 - K < 4 && weight.size(1) == K, "head_greedy: activations do not match the head");
  // q and r (signed, zero-padded), the row scales, sum(q), sum(r) and z |q|_2
  std::vector<int8_t> q(n * Kx, 0), r(n * Kx, 0);
  std::vector<float> s(n), sum_q(n), zq(n);
  std::vector<int32_t> corr_q(n), corr_r(n);
  for (int64_t i = 0; i < n; ++i) {
    const int8k::RowSums sums = quantize_row(x.data_ptr<float>() + i * K, K, &s[i], q.data() + i * Kx, r.data() + i * Kx);
    double ss = 0.0;
    for (int64_t k = 0; k < K; ++k) ss += double(q[i * Kx + k]) * q[i * Kx + k];
    sum_q[i] = static_cast<float>(sums.q);
    corr_q[i] = 128 * sums.q, corr_r[i] = 128 * sums.r;
    zq[i] = static_cast<float>(z * std::sqrt(ss));
  }
  std::vector<int32_t> xb(n * K4);  // the screen reads activations as K4 s8x4 words per row
  for (int64_t i = 0; i < n; ++i) std::memcpy(xb.data() + i * K4, q.data() + i * Kx, K4 * 4);
  auto out = torch::empty({n, N}, x.options());
  float* op = out.data_ptr<float>();
  const Screen sc{packed.data_ptr<uint8_t>(), mean.data_ptr<float>(), ws.data_ptr<float>(), margin.data_ptr<float>(),
                  K4, N};
  // one stream over the 4-bit copy for every row: per block, tiles of TILE_ROWS rows over chunks of its K
  std::vector<Found> found(n);  // every row's candidates and floor, merged from the chunks under `merge`
  std::mutex merge;
  const int64_t chunk = n <= int8k::TILE_ROWS ? K4 : CHUNK;
  const int tiles = static_cast<int>((n + int8k::TILE_ROWS - 1) / int8k::TILE_ROWS);
  int8k::parallel_for(0, packed.size(0), 1, [&](int64_t b0, int64_t b1) {
    // a chunk's own candidates, starting from the floors merged so far (a later chunk prunes harder)
    std::vector<Found> mine(n);
    {
      std::lock_guard<std::mutex> lock(merge);
      for (int64_t i = 0; i < n; ++i) mine[i].floor = found[i].floor;
    }
    std::vector<int32_t> acc(n * BLOCK);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = sc.packed + b * K4 * NIBBLE_BYTES;
      for (int64_t k0 = 0; k0 < K4; k0 += chunk) {
        int tile = 0;
        int8k::for_each_tile(n, [&](int64_t r0, int64_t R) {
          int8k::dispatch_rows(R, [&]<int T>() {
            screen_chunk<T>(wb, xb.data() + r0 * K4, K4, k0, std::min(chunk, K4 - k0), tile, tiles,
                            acc.data() + r0 * BLOCK);
          });
          ++tile;
        });
      }
      int8k::for_each_tile(n, [&](int64_t r0, int64_t R) {
        int8k::dispatch_rows(R, [&]<int T>() {
          estimate<T>(sc, acc.data() + r0 * BLOCK, sum_q.data() + r0, zq.data() + r0, mine.data() + r0, b);
        });
      });
    }
    std::lock_guard<std::mutex> lock(merge);
    for (int64_t i = 0; i < n; ++i) {
      found[i].floor = std::max(found[i].floor, mine[i].floor);
      found[i].v.insert(found[i].v.end(), mine[i].v.begin(), mine[i].v.end());
      found[i].est.insert(found[i].est.end(), mine[i].est.begin(), mine[i].est.end());
    }
  });
  // the candidates: upper bound est + zq sigma >= the row's floor (the largest lower bound of all chunks)
  auto counts = torch::zeros({n}, x.options().dtype(torch::kLong));
  int64_t* cp = counts.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int32_t>> cand;  // (row, token)
  for (int64_t i = 0; i < n; ++i) {
    const Found& f = found[i];
    for (size_t c = 0; c < f.v.size(); ++c)
      if (f.est[c] + zq[i] * sc.margin[f.v[c]] >= f.floor) cand.emplace_back(i, f.v[c]), ++cp[i];
  }
  // every other logit is -inf; the candidates' exact logits (the same epilogue as `linear`)
  int8k::parallel_for(0, n * N, 1 << 15, [&](int64_t e0, int64_t e1) { std::fill(op + e0, op + e1, -INFINITY); });
  const float* wsp = sc.ws;
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  int8k::parallel_for(0, static_cast<int64_t>(cand.size()), 16, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const auto [i, v] = cand[c];
      const int8_t* row = wp + static_cast<int64_t>(v) * K;
      const int32_t a0 = dot_row(row, q.data() + i * Kx, K, corr_q[i]);
      const int32_t a1 = dot_row(row, r.data() + i * Kx, K, corr_r[i]);
      op[i * N + v] = int8k::epilogue1(a0, a1, wsp[v], s[i], bp ? bp + v : nullptr);
    }
  });
  return {out, counts};
}

// The argmax of every row of fp32 logits (n, V) -> int64 (n,), as torch.argmax(-1) gives it: the first index of
// the largest value, and the first NaN's index where a row has one. torch's CPU argmax took 168 us a row of
// Qwen2.5's 151,936 logits here (1 ms for an 8-row step); one AVX-512 pass takes a few tens.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat, "argmax_rows: fp32 (n, V) logits");
  logits = logits.contiguous();
  const int64_t n = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1, "argmax_rows: empty rows");
  auto out = torch::empty({n}, logits.options().dtype(torch::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  int8k::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* row = lp + i * V;
      __m512 best = _mm512_set1_ps(-INFINITY);
      __m512i at = _mm512_set1_epi32(INT32_MAX);  // per lane: the first index of its largest value
      __mmask16 nan = 0;
      for (int64_t v = 0; v < V; v += 16) {
        const __mmask16 m = tail_mask(V - v);
        const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + v);
        const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(v)),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        nan |= _mm512_mask_cmp_ps_mask(m, x, x, _CMP_UNORD_Q);
        // larger, or the lane's first value at all (a row of -inf still names its first index)
        const __mmask16 take = _mm512_mask_cmp_ps_mask(m, x, best, _CMP_GT_OQ) |
                               (_mm512_cmpeq_epi32_mask(at, _mm512_set1_epi32(INT32_MAX)) & m);
        best = _mm512_mask_mov_ps(best, take, x);
        at = _mm512_mask_mov_epi32(at, take, idx);
        if (nan) break;
      }
      if (nan) {  // torch returns the first NaN
        int64_t k = 0;
        while (!std::isnan(row[k])) ++k;
        op[i] = k;
        continue;
      }
      const float top = _mm512_reduce_max_ps(best);
      op[i] = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ), at);
    }
  });
  return out;
}
