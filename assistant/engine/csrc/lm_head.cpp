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
//   4. computes the candidates' logits exactly from the row-major int8 head (a0, a1 over q and r, the same
//      epilogue as `linear`, bit for bit) and writes -inf for every other token.
// The argmax equals the full head's unless the winner's and a runner-up's errors together pass 2 Z sigma
// (Z = 8: a 16-sigma gap, beyond any probability that matters under that model; measured on real rows of
// Qwen2.5-0.5B, the largest |e_v| / sigma_v was 5.4 over ~5e7 token-rows). Ties resolve to the lowest
// index in both. Rows that sample use the full head.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "int8_common.h"
#include "native.h"

namespace {

using int8k::BLOCK;
using int8k::quantize_row;
using int8k::tail_mask;

constexpr int64_t NIBBLE_BYTES = 128;  // one (64 outputs x 4 inputs) group of 4-bit weights
constexpr int64_t PREFETCH = 4096;
constexpr int64_t SCREEN_ROWS = 8;  // rows per pass over the 4-bit copy

// q . (h + 8) + 128 * sum(h + 8) for one block of 64 outputs and R rows (u8 activations q + 128).
template <int R>
void screen_block(const uint8_t* w, const int32_t* xb, int64_t K4, __m512i (&acc)[R][4]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int64_t kg = 0; kg < K4; ++kg) {
    const uint8_t* p = w + kg * NIBBLE_BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH + 64), _MM_HINT_T1);
    const __m512i v0 = _mm512_loadu_si512(p), v1 = _mm512_loadu_si512(p + 64);
    const __m512i w0 = _mm512_and_si512(v0, low), w1 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low),
                  w2 = _mm512_and_si512(v1, low), w3 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(xb[r * K4 + kg]);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xv, w1);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], xv, w2);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], xv, w3);
    }
  }
}

struct Screen {  // the per-output data of the 4-bit copy
  const uint8_t* packed;
  const int32_t* comp;    // 128 * sum(h + 8) per output (padded)
  const float* mean;      // mean(l_v)
  const float* ws;        // the int8 head's channel scales
  const float* margin;    // std(l_v) * ws_v
  int64_t K4, N;
};

// For rows r0 .. r0 + R over a block range: est_v * ws_v into est, and the largest lower bound
// ws_v (est_v - zq sigma_v) of each row into floor_ (per row, max-combined).
template <int R>
void estimate(const Screen& sc, const int32_t* xb, const float* sum_q, const float* zq, float* est, float* floor_,
              int64_t b0, int64_t b1) {
  __m512 lower[R];
  for (int r = 0; r < R; ++r) lower[r] = _mm512_set1_ps(-INFINITY);
  for (int64_t b = b0; b < b1; ++b) {
    __m512i acc[R][4];
    screen_block<R>(sc.packed + b * sc.K4 * NIBBLE_BYTES, xb, sc.K4, acc);
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) {
        const int64_t col = b * BLOCK + 16 * j;
        if (col >= sc.N) break;
        const __mmask16 m = tail_mask(sc.N - col);
        // H = acc - comp - 8 sum(q);  est = 16 H + mean(l) sum(q)
        const __m512i h = _mm512_sub_epi32(_mm512_sub_epi32(acc[r][j], _mm512_loadu_si512(sc.comp + col)),
                                           _mm512_set1_epi32(8 * static_cast<int32_t>(sum_q[r])));
        const __m512 e = _mm512_mul_ps(
            _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(h), _mm512_set1_ps(16.f)),
                          _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sc.mean + col), _mm512_set1_ps(sum_q[r]))),
            _mm512_maskz_loadu_ps(m, sc.ws + col));
        _mm512_mask_storeu_ps(est + r * sc.N + col, m, e);
        const __m512 lo = _mm512_sub_ps(e, _mm512_mul_ps(_mm512_set1_ps(zq[r]), _mm512_maskz_loadu_ps(m, sc.margin + col)));
        lower[r] = _mm512_mask_max_ps(lower[r], m, lower[r], lo);
      }
    }
  }
  for (int r = 0; r < R; ++r) floor_[r] = _mm512_reduce_max_ps(lower[r]);
}

// Exact (u8 x + 128) . w - 128 * sum(w) = x . w for one row-major int8 weight row.
inline int32_t dot_row(const int8_t* w, const uint8_t* xu, int64_t K, int32_t comp) {
  __m512i acc = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 m = K - k >= 64 ? ~0ULL : (1ULL << (K - k)) - 1;
    acc = _mm512_dpbusd_epi32(acc, _mm512_maskz_loadu_epi8(m, xu + k), _mm512_maskz_loadu_epi8(m, w + k));
  }
  return _mm512_reduce_add_epi32(acc) - comp;
}

}  // namespace

// int8 (N, K) head -> the 4-bit high nibbles in the VNNI block layout (blocks, K4, 128) u8, their correction
// 128 * sum(h + 8) (int32, padded N), and per output the mean and standard deviation of the low nibbles.
std::vector<torch::Tensor> head_pack(torch::Tensor w) {
  auto padded = pad_weights(w);
  const int64_t Np = padded.size(0), Kp = padded.size(1);
  auto u = (padded.__rshift__(4) + 8).to(torch::kUInt8);  // h + 8 in [0, 15]
  auto comp = (u.to(torch::kInt32).sum(1) * 128).to(torch::kInt32).contiguous();
  auto v = u.view({Np / BLOCK, 4, 16, Kp / 4, 4}).permute({0, 3, 1, 2, 4}).reshape({Np / BLOCK, Kp / 4, 4, 64});
  using torch::indexing::Slice;
  auto lo = v.index({Slice(), Slice(), Slice(0, 4, 2)}), hi = v.index({Slice(), Slice(), Slice(1, 4, 2)});
  auto packed = lo.bitwise_or(hi.__lshift__(4)).reshape({Np / BLOCK, Kp / 4, NIBBLE_BYTES}).contiguous();
  auto l = w.bitwise_and(15).to(torch::kFloat);
  return {packed, comp, l.mean(1).contiguous(), l.std(1, /*unbiased=*/false).contiguous()};
}

// Greedy rows of the head: x fp32 (n, K) -> (n, N) with the exact `linear` logits (two-pass rows) of every
// candidate and -inf elsewhere; also the number of candidates per row (the bench reports them).
// margin (N,) = std(l_v) * ws_v; z: the candidate margin in standard deviations.
std::vector<torch::Tensor> head_greedy(torch::Tensor x, torch::Tensor packed, torch::Tensor hcomp, torch::Tensor mean,
                                       torch::Tensor margin, torch::Tensor weight, torch::Tensor comp, torch::Tensor ws,
                                       c10::optional<torch::Tensor> bias, double z) {
  x = x.contiguous();
  const int64_t n = x.size(0), K = x.size(1), K4 = packed.size(1), N = weight.size(0), Kx = (K + 63) / 64 * 64;
  TORCH_CHECK(K4 * 4 >= K && K4 * 4 - K < 4 && weight.size(1) == K, "head_greedy: activations do not match the head");
  // q and r as u8 (+ 128), padded; the row scales, sum(q) and z |q|_2
  std::vector<int8_t> q(n * Kx, 0), r(n * Kx, 0);
  std::vector<float> s(n), sum_q(n), zq(n);
  for (int64_t i = 0; i < n; ++i) {
    quantize_row(x.data_ptr<float>() + i * K, K, &s[i], q.data() + i * Kx, r.data() + i * Kx);
    double sq = 0.0, ss = 0.0;
    for (int64_t k = 0; k < K; ++k) sq += q[i * Kx + k], ss += double(q[i * Kx + k]) * q[i * Kx + k];
    sum_q[i] = static_cast<float>(sq);
    zq[i] = static_cast<float>(z * std::sqrt(ss));
  }
  for (auto* buf : {&q, &r})
    for (auto& v : *buf) v = static_cast<int8_t>(static_cast<uint8_t>(v) ^ 0x80);
  std::vector<int32_t> xb(n * K4);  // the screen reads activations as K4 u8x4 words per row
  for (int64_t i = 0; i < n; ++i) std::memcpy(xb.data() + i * K4, q.data() + i * Kx, K4 * 4);
  auto out = torch::empty({n, N}, x.options());
  float* op = out.data_ptr<float>();
  const Screen sc{packed.data_ptr<uint8_t>(), hcomp.data_ptr<int32_t>(), mean.data_ptr<float>(), ws.data_ptr<float>(),
                  margin.data_ptr<float>(), K4, N};
  const int64_t blocks = packed.size(0);
  std::vector<float> floor_(n, -INFINITY);
  for (int64_t r0 = 0; r0 < n; r0 += SCREEN_ROWS) {
    const int64_t R = std::min(SCREEN_ROWS, n - r0);
    std::vector<float> part(at::get_num_threads() * SCREEN_ROWS, -INFINITY);
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      const int32_t* xr = xb.data() + r0 * K4;
      float* fl = part.data() + at::get_thread_num() * SCREEN_ROWS;
      float local[SCREEN_ROWS];
      switch (R) {
#define CASE(C) case C: estimate<C>(sc, xr, sum_q.data() + r0, zq.data() + r0, op + r0 * N, local, b0, b1); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        default: break;
      }
      for (int64_t j = 0; j < R; ++j) fl[j] = std::max(fl[j], local[j]);
    });
    for (size_t t = 0; t < part.size(); t += SCREEN_ROWS)
      for (int64_t j = 0; j < R; ++j) floor_[r0 + j] = std::max(floor_[r0 + j], part[t + j]);
  }
  auto counts = torch::empty({n}, x.options().dtype(torch::kLong));
  const float* mp = sc.margin;
  const float* wsp = sc.ws;
  const int8_t* wp = weight.data_ptr<int8_t>();
  const int32_t* cp = comp.data_ptr<int32_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  std::vector<int32_t> cand(N);
  for (int64_t i = 0; i < n; ++i) {
    // candidates: est + zq sigma >= floor; every other logit becomes -inf on the way
    float* row = op + i * N;
    const __m512 zv = _mm512_set1_ps(zq[i]), fv = _mm512_set1_ps(floor_[i]);
    int64_t count = 0;
    for (int64_t v = 0; v < N; v += 16) {
      const __mmask16 m = tail_mask(N - v);
      const __m512 up = _mm512_add_ps(_mm512_maskz_loadu_ps(m, row + v), _mm512_mul_ps(zv, _mm512_maskz_loadu_ps(m, mp + v)));
      const __mmask16 keep = _mm512_mask_cmp_ps_mask(m, up, fv, _CMP_GE_OQ);
      const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(v)),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      _mm512_mask_compressstoreu_epi32(cand.data() + count, keep, idx);
      count += __builtin_popcount(keep);
      _mm512_mask_storeu_ps(row + v, m, minus_inf);
    }
    const uint8_t* qu = reinterpret_cast<const uint8_t*>(q.data() + i * Kx);
    const uint8_t* ru = reinterpret_cast<const uint8_t*>(r.data() + i * Kx);
    at::parallel_for(0, count, 64, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t v = cand[c];
        const int32_t a0 = dot_row(wp + v * K, qu, K, cp[v]), a1 = dot_row(wp + v * K, ru, K, cp[v]);
        row[v] = int8k::epilogue1(a0, a1, wsp[v], s[i], bp ? bp + v : nullptr);
      }
    });
    counts.data_ptr<int64_t>()[i] = count;
  }
  return {out, counts};
}
