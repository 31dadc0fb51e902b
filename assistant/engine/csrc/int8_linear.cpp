// int8 linear layers for the engine's decode steps: AVX-512 VNNI GEMV/GEMM with the row quantization and the
// epilogue fused into one call (see assistant/engine/native.py for why this is hand-written).
//
// Arithmetic, identical on every path so that a row's output never depends on the kernel or the batch:
//   s      = max(max|x|, 1e-8) / 127                       per row
//   u      = x / s ; q = round_half_even(u)                int8 in [-127, 127]
//   r      = round_half_even((u - q) * 254)                 residual, for rows that get the second pass
//   a0, a1 = exact int32 dot products of q, r with the int8 weight row
//   y      = ((float(a0) * ws) + (float(a1) * ws) * (1/254)) * s + bias     (one-pass rows: float(a0) * ws * s + bias)
//   outlier rows: x's m largest |x| (ties: the lower index) are zeroed before s, q are taken; o = their fp32 sum
//   through the int8 weights, in ascending index order; y = (float(a0) * ws) * s + o * ws + bias
// `quantize` + torch._int_mm + `finish` (prefill) and `linear` (<= MAX_ROWS rows) both compute exactly this;
// IEEE operations in a fixed order, built with -ffp-contract=off so no FMA can change a rounding.
//
// Design note: rows at the cost of one. A step with R decode rows (streams, speculated tokens) is R GEMM rows, plus
// R residual rows on the linears that refine generated rows (int8.py: `down`). The weights are streamed from memory
// once per step whatever R is; the multiply-adds grow with R. `vpdpbusd` takes unsigned bytes in its register
// operand and signed bytes in its broadcastable memory operand, so the weights are stored as w + 128 (unsigned) and
// the activations stay signed: (w + 128) . q = w . q + 128 sum(q), one correction per row instead of per output, and
// each row's broadcast rides on the instruction (no register, no extra uop). A tile of TILE_ROWS rows x 64 outputs
// keeps 24 accumulators and the 4 weight vectors in the 32 zmm registers (8 rows spilled: the old kernel's 8-row
// pass cost 2.3x its 4-row pass). Past one tile, a block's K runs in chunks of CHUNK words (8 KB of weights,
// L1-resident): every tile passes over a chunk, its accumulators parked in an L1 buffer between chunks, and every
// tile prefetches each word group of the stream ahead as it loads one, so the memory stream keeps flowing under all
// the tiles' multiply-adds instead of waiting for them pass by pass (the old kernel re-read a whole block from L2
// per 8-row pass; with the first tile prefetching the whole next chunk, the stream stalled while the later tiles
// ran: gate_up at 8 rows 14.3-15.2 -> 12.6-13.2 ms, native.py). The later tiles' prefetches repeat the first's, and
// that pays: with each of T tiles prefetching only every T-th word group, gate_up + down of 24 layers at 8 rows
// took 8.3 ms, with every tile prefetching all of them 7.4-7.5 (12 rows 8.7-9.0 -> 7.9-8.1, 16 rows 9.0-9.2 ->
// 8.8; 2026-11-30, Zen 5, 2 threads, alternating builds in one process), the same bits. Our reading, not
// measured: a prefetch that finds the core's miss buffers full is dropped, and a repeat catches it (the first
// tile alone prefetching every group was 19% slower at 16 rows, 3 tiles, than all of them doing it).
// Outlier rows (int8.py `Linear.outliers`, the default refinement on `down`) need no extra GEMM row: a refined
// row's m largest |x| are zeroed before its quantization (take_outliers: one vector compare per 16 inputs against
// the m-th largest so far) and their fp32 sum through the block's int8 columns is added in the epilogue, read from
// the same packed block the GEMM has just streamed (L1/L2), byte k % 4 of each output's word.
// Measured by bench/engine.py's step curve (native.py has the figures).
#include <torch/extension.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "int8_common.h"
#include "native.h"
#include "pool.h"
#if !defined(__AVX512F__)
#include "avx2_strips.h"
#endif

namespace {

using int8k::BLOCK;
using int8k::MAX_ROWS;
using int8k::TILE_ROWS;
using int8k::epilogue16;
using int8k::quantize_row;
using int8k::tail_mask;

constexpr int64_t PREFETCH = 8192;  // bytes ahead of the weight stream (measured: 4-8 KB best here)
constexpr int64_t QUANTIZE_GRAIN = 4;  // rows per thread when a step's rows are quantized in parallel
constexpr int64_t CHUNK = 32;       // K words per chunk when a block takes several tiles: 8 KB of weights

// Rows r0 .. r0 + R over K words [k0, k0 + n) of one block (w: the block's packed bytes): accumulators read
// from and written back to acc (when k0 == 0: zeroed, or on the AVX2 build started from the rows' corr, so that
// they end as the same (w + 128) . q). Every word group's load prefetches the one PREFETCH bytes ahead, whichever
// tile of a chunk it is: a later tile's prefetches repeat the first one's (see the design note).
template <int R>
void tile_chunk(const uint8_t* w, const int32_t* x, int64_t K4, int64_t k0, int64_t n, const int32_t* corr,
                int32_t (*acc)[BLOCK]) {
  const uint8_t* base = w + k0 * 256;
#if defined(__AVX512F__)
  __m512i a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = k0 ? _mm512_load_si512(acc[r] + 16 * j) : _mm512_setzero_si512();
  int8k::dot_tile<R>([&](int64_t kg, __m512i (&v)[4]) {
    const uint8_t* p = base + kg * 256;
    for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH + 64 * j), _MM_HINT_T1);
    for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_si512(p + 64 * j);
  }, x + k0, K4, n, a);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_store_si512(acc[r] + 16 * j, a[r][j]);
#else
  int8k::dot_tile_ymm<R>([&](int64_t kg, __m256i (&v)[8]) {
    const uint8_t* p = base + kg * 256;
    for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH + 64 * j), _MM_HINT_T1);
    for (int h = 0; h < 8; ++h) v[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
  }, x + k0, K4, n, acc[0], BLOCK, k0 ? nullptr : corr);
#endif
}

struct Rows {
  int64_t n;                  // activation rows
  std::vector<int64_t> res;   // res[i]: index of row i's residual row among the GEMM rows, or -1
  int64_t total;              // GEMM rows: activation rows + residual rows
  int outliers;               // > 0: refined rows keep this many outlier channels instead of a residual row
  std::vector<int8k::Outliers> outl;  // per row (n == 0: none)
};

// Every GEMM row over blocks [b0, b1) of 64 outputs (see the design note), then the epilogue of each activation
// row with its residual row. corr[g] = 128 * sum of GEMM row g's bytes (the weights' +128).
void run_blocks(const Rows& rows, const uint8_t* packed, const int32_t* xb, int64_t K4, const int32_t* corr,
                const float* ws, const float* xscale, const float* bias, float* out, int64_t N, int64_t b0, int64_t b1) {
  alignas(64) int32_t acc[MAX_ROWS][BLOCK];
  const int64_t chunk = rows.total <= TILE_ROWS ? K4 : CHUNK;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = packed + b * K4 * 256;
    for (int64_t k0 = 0; k0 < K4; k0 += chunk) {
      const int64_t n = std::min(chunk, K4 - k0);
      int8k::for_each_tile(rows.total, [&](int64_t r0, int64_t R) {
        int8k::dispatch_rows(R, [&]<int T>() { tile_chunk<T>(wb, xb + r0 * K4, K4, k0, n, corr + r0, acc + r0); });
      });
    }
    for (int64_t i = 0; i < rows.n; ++i) {
      const __m512 s = _mm512_set1_ps(xscale[i]);
      const bool two_pass = rows.res[i] >= 0;
      const __m512i c0 = _mm512_set1_epi32(corr[i]), c1 = _mm512_set1_epi32(two_pass ? corr[rows.res[i]] : 0);
      const int8k::Outliers* outl = rows.outliers && rows.outl[i].n ? &rows.outl[i] : nullptr;
      for (int j = 0; j < 4; ++j) {
        const int64_t col = b * BLOCK + 16 * j;
        if (col >= N) break;
        const __mmask16 m = tail_mask(N - col);
        const __m512 ws16 = _mm512_maskz_loadu_ps(m, ws + col);
        const __m512i a1 = two_pass ? _mm512_sub_epi32(_mm512_load_si512(acc[rows.res[i]] + 16 * j), c1)
                                    : _mm512_setzero_si512();
        const __m512 o = outl ? int8k::outlier_sums16(wb, *outl, j) : _mm512_setzero_ps();
        const __m512 y = epilogue16(_mm512_sub_epi32(_mm512_load_si512(acc[i] + 16 * j), c0), two_pass ? &a1 : nullptr,
                                    ws16, s, bias ? bias + col : nullptr, m, outl ? &o : nullptr);
        _mm512_mask_storeu_ps(out + i * N + col, m, y);
      }
    }
  }
}

// refine: bool (n,), the rows refined: by a residual row (outliers == 0) or by keeping `outliers` channels exact
Rows make_rows(const torch::Tensor& refine, int64_t n, int64_t outliers) {
  TORCH_CHECK(outliers >= 0 && outliers <= int8k::MAX_OUTLIERS, "at most ", int8k::MAX_OUTLIERS, " outlier channels");
  Rows rows{n, std::vector<int64_t>(n, -1), n, static_cast<int>(outliers), {}};
  if (outliers) rows.outl.resize(n);
  const bool* rp = refine.data_ptr<bool>();
  for (int64_t i = 0; i < n; ++i)
    if (rp[i] && !outliers) rows.res[i] = rows.total++;
  return rows;
}

// Row i of x (K floats) into its int8 GEMM row q, and its residual row r or its outliers (rows.outl[i]) when
// refined; corr (when given) gets 128 * each GEMM row's byte sum.
void quantize_into(Rows& rows, const bool* refine, const float* x, int64_t K, int64_t i, float* scale, int8_t* q,
                   int8_t* r, int32_t* corr) {
  if (rows.outliers && refine[i]) {
    thread_local std::vector<float> rest;
    rest.resize(std::max<size_t>(rest.size(), K));
    int8k::take_outliers(x, K, rows.outliers, &rows.outl[i], rest.data());
    const int32_t sum = quantize_row(rest.data(), K, scale, q, nullptr).q;
    if (corr) corr[i] = 128 * sum;
    return;
  }
  const int8k::RowSums sums = quantize_row(x, K, scale, q, rows.res[i] >= 0 ? r : nullptr);
  if (corr) corr[i] = 128 * sums.q;
  if (corr && rows.res[i] >= 0) corr[rows.res[i]] = 128 * sums.r;
}

}  // namespace

// int8 (N, K) weights -> zeros-padded (N to BLOCK outputs, K to 4 inputs)
torch::Tensor pad_weights(torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kInt8 && w.dim() == 2, "the int8 kernels want int8 (N, K) weights");
  const int64_t N = w.size(0), K = w.size(1);
  auto padded = torch::zeros({(N + BLOCK - 1) / BLOCK * BLOCK, (K + 3) / 4 * 4}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded;
}

// int8 (N, K) weights -> w + 128 as u8 in the VNNI block layout (blocks, K4, 64, 4) (padding: 128, against
// activations that are 0 there). The layout's plain definition in tensor ops: the engine packs with
// `quantize_pack`, and the tests hold it to this.
torch::Tensor pack(torch::Tensor w) {
  auto padded = pad_weights(w);
  const int64_t Np = padded.size(0), Kp = padded.size(1);
  auto u = (padded.to(torch::kInt16) + 128).to(torch::kUInt8);
  return u.view({Np / BLOCK, BLOCK, Kp / 4, 4}).permute({0, 2, 1, 3}).contiguous();
}

// fp32 weights, given as parts stacked along the outputs ((N_i, K) each: q, k and v; gate and up), -> [int8 (N, K),
// scales fp32 (N,), `pack` of the int8] in one pass over the weights, parallel over blocks of 64 outputs, with no
// concatenated fp32 copy: the same numbers as int8.py's torch ops (scale = max(max|w|, 1e-8) / 127, q =
// clamp(round_half_even(w / scale), -127, 127)). The 1.5B model's engine build spent ~7 s in those ops, ~5 s in
// `pack` and ~3.5 s concatenating fp32 parts, one thread each.
std::vector<torch::Tensor> quantize_pack(std::vector<torch::Tensor> parts) {
  TORCH_CHECK(!parts.empty(), "quantize_pack wants at least one part");
  const int64_t K = parts[0].size(1);
  std::vector<const float*> rows_of;
  for (auto& part : parts) {
    TORCH_CHECK(part.dtype() == torch::kFloat32 && part.dim() == 2 && part.size(1) == K,
                "quantize_pack wants fp32 (N_i, K) parts with one K");
    part = part.contiguous();
    for (int64_t i = 0; i < part.size(0); ++i) rows_of.push_back(part.data_ptr<float>() + i * K);
  }
  const int64_t N = static_cast<int64_t>(rows_of.size()), K4 = (K + 3) / 4, blocks = (N + BLOCK - 1) / BLOCK;
  const auto options = parts[0].options();
  auto q = torch::empty({N, K}, options.dtype(torch::kInt8));
  auto scale = torch::empty({N}, options);
  auto packed = torch::empty({blocks, K4, BLOCK, 4}, options.dtype(torch::kUInt8));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  int8k::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint8_t* block = pp + b * K4 * BLOCK * 4;
      for (int64_t r = 0; r < BLOCK; ++r) {
        const int64_t n = b * BLOCK + r;
        if (n >= N) {  // padding outputs: weight 0, stored + 128
          for (int64_t k = 0; k < K4 * 4; ++k) block[((k / 4) * BLOCK + r) * 4 + k % 4] = 128;
          continue;
        }
        const float* row = rows_of[n];
        float amax = 0.f;
        for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
        const float s = std::max(amax, 1e-8f) / 127.f;
        sp[n] = s;
        for (int64_t k = 0; k < K4 * 4; ++k) {
          int8_t v = 0;
          if (k < K) {
            v = static_cast<int8_t>(std::clamp(std::nearbyint(row[k] / s), -127.f, 127.f));
            qp[n * K + k] = v;
          }
          block[((k / 4) * BLOCK + r) * 4 + k % 4] = static_cast<uint8_t>(v + 128);
        }
      }
    }
  });
  return {q, scale, packed};
}

// x fp32 (n, K), refine bool (n,) -> int8 (n + residual rows, K) GEMM rows for torch._int_mm, row scales fp32 (n,),
// and with outliers > 0 the refined rows' outlier channels (int32 (n, outliers), -1 past a row's own; fp32 values)
std::vector<torch::Tensor> quantize(torch::Tensor x, torch::Tensor refine, int64_t outliers) {
  x = x.contiguous();
  const int64_t n = x.size(0), K = x.size(1);
  Rows rows = make_rows(refine, n, outliers);
  auto xq = torch::empty({rows.total, K}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({n}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  const bool* rp = refine.data_ptr<bool>();
  int8k::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      quantize_into(rows, rp, xp + i * K, K, i, sp + i, qp + i * K, rows.res[i] >= 0 ? qp + rows.res[i] * K : nullptr,
                    nullptr);
  });
  if (!outliers) return {xq, scale};
  auto idx = torch::full({n, outliers}, -1, x.options().dtype(torch::kInt32));
  auto val = torch::zeros({n, outliers}, x.options());
  for (int64_t i = 0; i < n; ++i)
    for (int k = 0; k < rows.outl[i].n; ++k) {
      idx.data_ptr<int32_t>()[i * outliers + k] = rows.outl[i].idx[k];
      val.data_ptr<float>()[i * outliers + k] = rows.outl[i].val[k];
    }
  return {xq, scale, idx, val};
}

// `finish`'s rows: `make_rows`, with each refined row's outlier channels from `quantize`'s idx and val.
Rows finish_rows(const torch::Tensor& refine, int64_t n, const c10::optional<torch::Tensor>& outlier_idx,
                 const c10::optional<torch::Tensor>& outlier_val, bool packed) {
  const int64_t m = outlier_idx ? outlier_idx->size(1) : 0;
  TORCH_CHECK(!m || (packed && outlier_val), "finish: outlier rows need the packed weights and their values");
  Rows rows = make_rows(refine, n, m);
  for (int64_t i = 0; m && i < n; ++i) {
    int8k::Outliers& o = rows.outl[i];
    for (; o.n < m && outlier_idx->data_ptr<int32_t>()[i * m + o.n] >= 0; ++o.n) {
      o.idx[o.n] = outlier_idx->data_ptr<int32_t>()[i * m + o.n];
      o.val[o.n] = outlier_val->data_ptr<float>()[i * m + o.n];
    }
  }
  return rows;
}

// The epilogue of `finish` for one row's 16 outputs at `col` (a0: the row's accumulators there, a1: its residual
// row's or null), written to out (n, N).
struct Finish {
  const Rows& rows;
  const float *ws, *xscale, *bias;
  const uint8_t* packed;  // for outlier rows
  int64_t K4, N;
  float* out;

  void operator()(int64_t i, int64_t col, const int32_t* a0, const int32_t* a1) const {
    const __mmask16 mk = tail_mask(N - col);
    const int8k::Outliers* outl = rows.outliers && rows.outl[i].n ? &rows.outl[i] : nullptr;
    const __m512i v0 = _mm512_maskz_loadu_epi32(mk, a0);
    __m512i v1;
    if (a1) v1 = _mm512_maskz_loadu_epi32(mk, a1);
    const __m512 o = outl ? int8k::outlier_sums16(packed + (col / BLOCK) * K4 * 256, *outl, (col % BLOCK) / 16)
                          : _mm512_setzero_ps();
    const __m512 y = epilogue16(v0, a1 ? &v1 : nullptr, _mm512_maskz_loadu_ps(mk, ws + col), _mm512_set1_ps(xscale[i]),
                                bias ? bias + col : nullptr, mk, outl ? &o : nullptr);
    _mm512_mask_storeu_ps(out + i * N + col, mk, y);
  }
};

// acc int32 (n + residual rows, N) from torch._int_mm -> fp32 (n, N), the same epilogue as `linear`; rows with
// outliers (`quantize`'s idx and val) add their sums, read from the packed weights like `linear` does.
torch::Tensor finish(torch::Tensor acc, torch::Tensor ws, torch::Tensor xscale, torch::Tensor refine,
                     c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> packed,
                     c10::optional<torch::Tensor> outlier_idx, c10::optional<torch::Tensor> outlier_val) {
  acc = acc.contiguous();
  const int64_t n = xscale.size(0), N = acc.size(1);
  const Rows rows = finish_rows(refine, n, outlier_idx, outlier_val, packed.has_value());
  auto out = torch::empty({n, N}, ws.options());
  const Finish epi{rows, ws.data_ptr<float>(), xscale.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
                   rows.outliers ? packed->data_ptr<uint8_t>() : nullptr, rows.outliers ? packed->size(1) : 0, N,
                   out.data_ptr<float>()};
  const int32_t* ap = acc.data_ptr<int32_t>();
  int8k::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t col = 0; col < N; col += 16)
        epi(i, col, ap + i * N + col, rows.res[i] >= 0 ? ap + rows.res[i] * N + col : nullptr);
  });
  return out;
}

// The fused decode linear: x fp32 (n, K) -> fp32 (n, N), n + residual rows <= MAX_ROWS. Refined rows get a residual
// row, or with outliers > 0 keep that many channels exact (int8.py `Linear.outliers`).
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor ws, c10::optional<torch::Tensor> bias,
                     torch::Tensor refine, int64_t outliers) {
  x = x.contiguous();
  const int64_t n = x.size(0), K = x.size(1), K4 = packed.size(1), blocks = packed.size(0), N = ws.size(0);
  TORCH_CHECK(packed.dtype() == torch::kUInt8, "linear: packed weights come from `pack`");
  TORCH_CHECK(K4 * 4 >= K && K4 * 4 - K < 4, "linear: activations do not match the packed weights");
  Rows rows = make_rows(refine, n, outliers);
  const int64_t total = rows.total;
  TORCH_CHECK(total <= MAX_ROWS, "linear takes at most ", MAX_ROWS, " GEMM rows");
  std::vector<int8_t> q(total * K4 * 4, 0);  // padded K stays 0
  std::vector<float> xscale(n);
  std::vector<int32_t> corr(total);  // 128 * sum(q) per GEMM row: the weights' + 128
  const bool* rp = refine.data_ptr<bool>();
  int8k::parallel_for(0, n, QUANTIZE_GRAIN, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      quantize_into(rows, rp, x.data_ptr<float>() + i * K, K, i, &xscale[i], q.data() + i * K4 * 4,
                    rows.res[i] >= 0 ? q.data() + rows.res[i] * K4 * 4 : nullptr, corr.data());
  });
  auto out = torch::empty({n, N}, x.options());
  const int32_t* xb = reinterpret_cast<const int32_t*>(q.data());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  int8k::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    run_blocks(rows, packed.data_ptr<uint8_t>(), xb, K4, corr.data(), ws.data_ptr<float>(), xscale.data(), bp,
               out.data_ptr<float>(), N, b0, b1);
  });
  return out;
}

#if !defined(__AVX512F__)
// The AVX2 build's torch._int_mm(xq, W.T), exact, over `pack`'s layout: prompt chunks past MAX_ROWS (int8.py), where
// oneDNN has no VNNI and takes a slow path. Each 16-output group of a block is a strip of avx2_strips.h (the GEMM
// avx2_gemv.cpp runs over its own copy), its bytes flipped back to the signed weight (w + 128 xor 0x80).
torch::Tensor int_mm(torch::Tensor xq, torch::Tensor packed, int64_t N) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == torch::kInt8, "int_mm: int8 (R, K) rows");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == BLOCK && packed.size(3) == 4 && packed.size(0) * BLOCK >= N,
              "int_mm: weights from pack");
  const int64_t K4 = packed.size(1);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  return int8k::strip_gemm(xq, N, K4, 256, true, [&](int64_t s) { return w + (s / 4) * K4 * 256 + (s % 4) * 64; });
}

// finish(int_mm(xq, packed, N), ...) in one pass: each strip's accumulators (every GEMM row, 16 outputs) go through
// the epilogue while they are in cache, instead of through an (n + residual rows, N) int32 tensor. The same bits.
torch::Tensor int_mm_finish(torch::Tensor xq, torch::Tensor packed, torch::Tensor ws, torch::Tensor xscale,
                            torch::Tensor refine, c10::optional<torch::Tensor> bias,
                            c10::optional<torch::Tensor> outlier_idx, c10::optional<torch::Tensor> outlier_val) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == torch::kInt8, "int_mm_finish: int8 (R, K) rows");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == BLOCK && packed.size(3) == 4, "int_mm_finish: weights from pack");
  const int64_t n = xscale.size(0), N = ws.size(0), K4 = packed.size(1);
  TORCH_CHECK(packed.size(0) * BLOCK >= N, "int_mm_finish: ", N, " outputs for ", packed.size(0) * BLOCK, " packed");
  const Rows rows = finish_rows(refine, n, outlier_idx, outlier_val, true);
  TORCH_CHECK(xq.size(0) == rows.total, "int_mm_finish: ", xq.size(0), " GEMM rows for ", rows.total);
  auto out = torch::empty({n, N}, ws.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const Finish epi{rows, ws.data_ptr<float>(), xscale.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr, w,
                   K4, N, out.data_ptr<float>()};
  int8k::strip_gemm_each(xq, N, K4, 256, true, [&](int64_t s) { return w + (s / 4) * K4 * 256 + (s % 4) * 64; },
                         [&](int64_t s, const int32_t* acc) {  // acc: (rows.total, 16)
                           for (int64_t i = 0; i < n; ++i)
                             epi(i, s * 16, acc + i * 16, rows.res[i] >= 0 ? acc + rows.res[i] * 16 : nullptr);
                         });
  return out;
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();  // steps run on the engine thread
  m.def("pack", &pack, nogil, "int8 (N, K) -> VNNI-packed weights + 128 (u8)");
  m.def("quantize_pack", &quantize_pack, nogil, "fp32 weight parts (stacked) -> int8 weights, their scales and `pack` of them");
  m.def("quantize", &quantize, nogil, "rows -> int8 GEMM rows (with residual rows) and row scales");
  m.def("finish", &finish, nogil, "int32 accumulators -> fp32 outputs");
  m.def("linear", &linear, nogil, "fused decode linear (quantize, VNNI GEMV, epilogue)");
  m.def("head_pack", &head_pack, nogil, "int8 head -> its 4-bit high nibbles (VNNI layout) and low-nibble statistics");
  m.def("head_greedy", &head_greedy, nogil, "greedy rows: exact logits of the screened candidates, -inf elsewhere");
  m.def("argmax_rows", &argmax_rows, nogil, "torch.argmax(logits, -1) of fp32 (n, V) logits, in one AVX-512 pass");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm over rows");
  m.def("rope_store", &rope_store, nogil, "rotary embedding of q and k, k and v written to the KV cache");
  m.def("attend", &attend, nogil, "causal attention of a step's queries over paged KV slots");
  m.def("swiglu", &swiglu, nogil, "silu(gate) * up over (T, 2F) rows");
  register_decode_stack(m);
#if !defined(__AVX512F__)
  m.def("int_mm", &int_mm, nogil, "torch._int_mm(xq, W.T) over pack(W), exact (the AVX2 build)");
  m.def("int_mm_finish", &int_mm_finish, nogil, "finish(int_mm(...), ...) in one pass (the AVX2 build)");
#endif
  m.def("set_threads", [](int n) { int8k::pool().resize(n); }, nogil,
        "threads the kernels split their work over, the caller included (1: only the caller)");
  m.def("threads", [] { return int8k::pool().threads(); }, "threads the kernels split their work over");
  m.attr("MAX_ROWS") = MAX_ROWS;
}
