// Shared-prefix decode attention: the n requests of a group whose block tables
// start with the same P physical blocks attend to those prefix_len positions together, each
// K/V row loaded once for all n·g query rows of its KV head, as a small matrix product; then
// each request's own suffix (paged_decode_attention_lse, decode_attention.cpp) and the merge
// of both parts through their log-sum-exp (merge_attention_states, here).
//
// Layout (AVX512-BF16, no AMX): the query rows of one KV head are packed once as "row
// groups" of 16 rows in VNNI pairs, qt[rg][kp][lane] = (q[2kp], q[2kp+1]) of row 16·rg +
// lane, so a score vector holds one position's scores for 16 rows and a K row is read in
// place as 32-bit broadcasts (no horizontal sums, no K repacking). The softmax then runs
// lane-wise over positions; P goes to bf16 pairs of positions (p[s], p[s+1]) per row lane,
// and the PV product accumulates out[d] for 16 rows per vector from broadcast pairs
// (V[s][d], V[s+1][d]) of a per-chunk interleaved copy of V.
//
// int8 pools: each task widens its chunk's K and V codes to bf16 once (exact) for all n·g rows;
// the K scale multiplies each position's scores, the V scale each position's probability
// before its bf16 rounding (the sum of probabilities stays unscaled, in fp32).
//
// Work: (KV head × chunk of kChunk positions) tasks, each writing its unnormalised output,
// row max and Σ e^(s - max) per row; a second pass merges the chunks in order. Every row's
// arithmetic (its lane of each dot product over H, the order over positions, the chunk
// split, which depends on prefix_len only) is the same whatever the other rows of the group,
// so a row's result does not depend on the group's size (tested bitwise).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "../kernels.h"
#include "vec_math.h"

KVSERVE_KERNEL_FAMILY("shared_prefix_attention");

namespace {

constexpr int64_t kChunk = 256;  // positions per task (a multiple of kPosBlock)
constexpr int64_t kPosBlock = 8;  // positions per score step (scores padded to a multiple)
constexpr int kMaxRowGroupsPerPass = 4;  // row groups whose accumulators stay in registers

// scores of positions [0, S_pad) for row groups rg0..rg0+RG-1: sc[(s·RGT + rg)·16 + lane]
// (with pos_scale: position s's scores times pos_scale[s] instead of scale: an int8 K row's scale)
template <int RG, int P>
void chunk_scores(const uint32_t* qt, int64_t KP, const uint32_t* const* k_rows, int64_t S_pad, int64_t RGT,
                  int64_t rg0, float scale, const float* pos_scale, float* sc) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t s0 = 0; s0 < S_pad; s0 += P) {
    if (s0 + 16 < S_pad)
      for (int p = 0; p < P; ++p)
        for (int64_t byte = 0; byte < KP * 4; byte += 64)
          _mm_prefetch(reinterpret_cast<const char*>(k_rows[s0 + 16 + p]) + byte, _MM_HINT_T0);
    __m512 acc[P][RG];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) acc[p][r] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < KP; ++kp) {
      __m512bh qv[RG];
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) qv[r] = (__m512bh)_mm512_loadu_si512(qt + ((rg0 + r) * KP + kp) * 16);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(k_rows[s0 + p][kp]));
#pragma GCC unroll 4
        for (int r = 0; r < RG; ++r) acc[p][r] = _mm512_dpbf16_ps(acc[p][r], qv[r], kb);
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r)
        _mm512_storeu_ps(sc + ((s0 + p) * RGT + rg0 + r) * 16,
                         _mm512_mul_ps(acc[p][r], pos_scale ? _mm512_set1_ps(pos_scale[s0 + p]) : scale_v));
  }
}

// accT[(k)·RGT·16 + rg·16 + lane] = Σ_pairs dpbf16 of P pairs and V pairs, features k0..k0+KB-1
template <int RG, int KB>
void chunk_values(const uint32_t* pp, const uint32_t* vp, int64_t pairs, int64_t H, int64_t RGT, int64_t rg0,
                  float* accT) {
  for (int64_t k0 = 0; k0 < H; k0 += KB) {
    __m512 acc[KB][RG];
#pragma GCC unroll 8
    for (int k = 0; k < KB; ++k)
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) acc[k][r] = _mm512_setzero_ps();
    for (int64_t t = 0; t < pairs; ++t) {
      __m512bh pv[RG];
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) pv[r] = (__m512bh)_mm512_loadu_si512(pp + (t * RGT + rg0 + r) * 16);
      const uint32_t* vrow = vp + t * H + k0;
#pragma GCC unroll 8
      for (int k = 0; k < KB; ++k) {
        const __m512bh vb = (__m512bh)_mm512_set1_epi32(static_cast<int>(vrow[k]));
#pragma GCC unroll 4
        for (int r = 0; r < RG; ++r) acc[k][r] = _mm512_dpbf16_ps(acc[k][r], pv[r], vb);
      }
    }
#pragma GCC unroll 8
    for (int k = 0; k < KB; ++k)
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) _mm512_storeu_ps(accT + ((k0 + k) * RGT + rg0 + r) * 16, acc[k][r]);
  }
}

void scores_pass(int RG, const uint32_t* qt, int64_t KP, const uint32_t* const* k_rows, int64_t S_pad, int64_t RGT,
                 int64_t rg0, float scale, const float* pos_scale, float* sc) {
  switch (RG) {
    case 1: chunk_scores<1, 8>(qt, KP, k_rows, S_pad, RGT, rg0, scale, pos_scale, sc); break;
    case 2: chunk_scores<2, 8>(qt, KP, k_rows, S_pad, RGT, rg0, scale, pos_scale, sc); break;
    case 3: chunk_scores<3, 4>(qt, KP, k_rows, S_pad, RGT, rg0, scale, pos_scale, sc); break;
    default: chunk_scores<4, 4>(qt, KP, k_rows, S_pad, RGT, rg0, scale, pos_scale, sc); break;
  }
}

// an int8 row of H codes as bf16 (exact: |c| <= 128 fits bf16's 8 significant bits)
inline void widen_int8_row(const int8_t* src, int64_t H, uint16_t* dst) {
  for (int64_t d = 0; d < H; d += 16) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(f));
  }
}

void values_pass(int RG, const uint32_t* pp, const uint32_t* vp, int64_t pairs, int64_t H, int64_t RGT, int64_t rg0,
                 float* accT) {
  switch (RG) {
    case 1: chunk_values<1, 8>(pp, vp, pairs, H, RGT, rg0, accT); break;
    case 2: chunk_values<2, 8>(pp, vp, pairs, H, RGT, rg0, accT); break;
    case 3: chunk_values<3, 4>(pp, vp, pairs, H, RGT, rg0, accT); break;
    default: chunk_values<4, 4>(pp, vp, pairs, H, RGT, rg0, accT); break;
  }
}

// (a[d], b[d]) pairs of two bf16 rows of 32·chunks features, in feature order, 32 bits each
inline void interleave_rows(const at::BFloat16* a, const at::BFloat16* b, int64_t chunks, uint32_t* dst) {
  const __m512i to_lo = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i to_hi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512i x = _mm512_loadu_si512(a + c * 32), y = _mm512_loadu_si512(b + c * 32);
    const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
    _mm512_storeu_si512(dst + c * 32, _mm512_permutex2var_epi32(lo, to_lo, hi));
    _mm512_storeu_si512(dst + c * 32 + 16, _mm512_permutex2var_epi32(lo, to_hi, hi));
  }
}

}  // namespace

// q [n, N_q, H] bf16; pools [num_blocks, block_size, N_kv, H] bf16; prefix_blocks int32 [P];
// positions [0, prefix_len) of those blocks, visible to every query (non-causal). Returns
// (out [n, N_q, H] fp32 normalised, lse [n, N_q] fp32 = max + log Σ exp(scale·q·k)).
std::tuple<at::Tensor, at::Tensor> shared_prefix_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                                           at::Tensor prefix_blocks, int64_t prefix_len, double scale,
                                                           c10::optional<at::Tensor> k_scale,
                                                           c10::optional<at::Tensor> v_scale) {
  check_shared_prefix_args(q, k_pool, v_pool, prefix_blocks, prefix_len, k_scale, v_scale);
  const bool int8 = k_pool.scalar_type() == at::kChar;
  const int64_t n = q.size(0), num_heads = q.size(1), H = q.size(2);
  const int64_t block_size = k_pool.size(1), num_kv_heads = k_pool.size(2);
  q = q.contiguous();
  prefix_blocks = prefix_blocks.contiguous();
  const int32_t* blocks = prefix_blocks.data_ptr<int32_t>();

  auto out = at::empty({n, num_heads, H}, q.options().dtype(at::kFloat));
  auto lse = at::empty({n, num_heads}, q.options().dtype(at::kFloat));
  float* out_p = out.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();
  if (n == 0) return {out, lse};
  if (prefix_len == 0) {
    out.zero_();
    lse.fill_(-INFINITY);
    return {out, lse};
  }

  const int64_t g = num_heads / num_kv_heads;
  const int64_t M = n * g;                // query rows per KV head
  const int64_t RGT = (M + 15) / 16;      // row groups of 16
  const int64_t KP = H / 2;               // feature pairs
  const int64_t chunks = (prefix_len + kChunk - 1) / kChunk;
  const int64_t slot_stride = num_kv_heads * H;
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  // element pointers of either pool dtype (bf16: 2 bytes, int8: 1), and the int8 scales
  const auto* kd = static_cast<const char*>(k_pool.data_ptr());
  const auto* vd = static_cast<const char*>(v_pool.data_ptr());
  const int64_t elem = int8 ? 1 : 2;
  const float* ksd = int8 ? k_scale->data_ptr<float>() : nullptr;
  const float* vsd = int8 ? v_scale->data_ptr<float>() : nullptr;
  const float fscale = static_cast<float>(scale);

  // the query rows of each KV head in VNNI pairs, row m = b·g + j (head kvh·g + j of request b)
  std::vector<uint32_t> qt(num_kv_heads * RGT * KP * 16, 0);
  for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh)
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* row = qd + ((m / g) * num_heads + kvh * g + m % g) * H;
      uint32_t* dst = qt.data() + (kvh * RGT + m / 16) * KP * 16 + m % 16;
      for (int64_t kp = 0; kp < KP; ++kp) dst[kp * 16] = uint32_t(row[2 * kp]) | (uint32_t(row[2 * kp + 1]) << 16);
    }

  // per chunk: unnormalised output [n, N_q, H], row max and Σ e^(s - max) [n, N_q]
  std::vector<float> part_acc(chunks * n * num_heads * H), part_max(chunks * n * num_heads), part_sum(chunks * n * num_heads);

  at::parallel_for(0, num_kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<const uint32_t*> k_rows;
    std::vector<float> sc, accT, kpos_scale, vpos_scale;
    std::vector<uint32_t> pp, vp;
    std::vector<uint16_t> kbuf, vrow_a, vrow_b;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kvh = task / chunks, c = task % chunks;
      const int64_t p0 = c * kChunk, S = std::min(kChunk, prefix_len - p0);
      const int64_t S_pad = (S + kPosBlock - 1) / kPosBlock * kPosBlock, pairs = S_pad / 2;
      auto slot_of = [&](int64_t pos) { return static_cast<int64_t>(blocks[pos / block_size]) * block_size + pos % block_size; };
      auto k_at = [&](int64_t pos) { return kd + (slot_of(pos) * slot_stride + kvh * H) * elem; };
      auto v_at = [&](int64_t pos) { return vd + (slot_of(pos) * slot_stride + kvh * H) * elem; };
      k_rows.resize(S_pad);
      if (int8) {  // the chunk's K codes widened once, its K scales (times the softmax scale) per position
        kbuf.resize(S_pad * H);
        kpos_scale.resize(S_pad);
        vpos_scale.assign(S_pad, 0.f);
        for (int64_t s = 0; s < S_pad; ++s) {
          const int64_t pos = p0 + (s < S ? s : 0);  // padding repeats position p0; its scores are never used
          widen_int8_row(reinterpret_cast<const int8_t*>(k_at(pos)), H, kbuf.data() + s * H);
          k_rows[s] = reinterpret_cast<const uint32_t*>(kbuf.data() + s * H);
          kpos_scale[s] = ksd[slot_of(pos) * num_kv_heads + kvh] * fscale;
          if (s < S) vpos_scale[s] = vsd[slot_of(pos) * num_kv_heads + kvh];
        }
      } else {
        for (int64_t s = 0; s < S_pad; ++s)  // padding reads position p0's row; its scores are never used
          k_rows[s] = reinterpret_cast<const uint32_t*>(k_at(p0 + (s < S ? s : 0)));
        // the first K rows into L1 while V is copied (chunk_scores prefetches the rest ahead)
        for (int64_t s = 0; s < std::min<int64_t>(16, S); ++s)
          for (int64_t byte = 0; byte < H * 2; byte += 64) _mm_prefetch(reinterpret_cast<const char*>(k_rows[s]) + byte, _MM_HINT_T0);
      }
      // V in pairs of positions (V[s][d], V[s+1][d]), zero past S (int8: the codes widened first)
      vp.assign(pairs * H, 0);
      vrow_a.resize(H);
      vrow_b.resize(H);
      auto v_row = [&](int64_t pos, std::vector<uint16_t>& tmp) -> const at::BFloat16* {
        if (!int8) return reinterpret_cast<const at::BFloat16*>(v_at(pos));
        widen_int8_row(reinterpret_cast<const int8_t*>(v_at(pos)), H, tmp.data());
        return reinterpret_cast<const at::BFloat16*>(tmp.data());
      };
      for (int64_t t = 0; t < pairs; ++t) {
        const int64_t s = 2 * t;
        for (int64_t ahead = s + 16; ahead < std::min(S, s + 18); ++ahead)  // blocks sit anywhere: no hardware prefetch across them
          for (int64_t byte = 0; byte < H * elem; byte += 64) _mm_prefetch(v_at(p0 + ahead) + byte, _MM_HINT_T0);
        if (s + 1 < S) {
          interleave_rows(v_row(p0 + s, vrow_a), v_row(p0 + s + 1, vrow_b), H / 32, vp.data() + t * H);
        } else if (s < S) {
          const auto* ar = reinterpret_cast<const uint16_t*>(v_row(p0 + s, vrow_a));
          for (int64_t d = 0; d < H; ++d) vp[t * H + d] = ar[d];
        }
      }
      // scores of every row group, 16 rows per vector
      sc.resize(S_pad * RGT * 16);
      const uint32_t* qk = qt.data() + kvh * RGT * KP * 16;
      for (int64_t rg0 = 0; rg0 < RGT; rg0 += kMaxRowGroupsPerPass)
        scores_pass(static_cast<int>(std::min<int64_t>(kMaxRowGroupsPerPass, RGT - rg0)), qk, KP, k_rows.data(), S_pad, RGT,
                    rg0, fscale, int8 ? kpos_scale.data() : nullptr, sc.data());
      // softmax lane-wise over positions: max, e^(s - max) to bf16 pairs, Σ in fp32
      pp.assign(pairs * RGT * 16, 0);
      std::vector<__m512> mx(RGT), sum(RGT);
      for (int64_t rg = 0; rg < RGT; ++rg) {
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t s = 0; s < S; ++s) m = _mm512_max_ps(m, _mm512_loadu_ps(sc.data() + (s * RGT + rg) * 16));
        __m512 total = _mm512_setzero_ps();
        for (int64_t t = 0; t < pairs; ++t) {
          const int64_t s = 2 * t;
          __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps();
          if (s < S) {
            e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc.data() + (s * RGT + rg) * 16), m));
            total = _mm512_add_ps(total, e0);
          }
          if (s + 1 < S) {
            e1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc.data() + ((s + 1) * RGT + rg) * 16), m));
            total = _mm512_add_ps(total, e1);
          }
          if (int8) {  // the V scale weights the probability (Σ above stays unscaled)
            e0 = _mm512_mul_ps(e0, _mm512_set1_ps(vpos_scale[s]));
            e1 = _mm512_mul_ps(e1, _mm512_set1_ps(vpos_scale[s + 1]));
          }
          const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e0));
          const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e1));
          _mm512_storeu_si512(pp.data() + (t * RGT + rg) * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        mx[rg] = m;
        sum[rg] = total;
      }
      // PV, out transposed: accT[d][row]
      accT.resize(H * RGT * 16);
      for (int64_t rg0 = 0; rg0 < RGT; rg0 += kMaxRowGroupsPerPass)
        values_pass(static_cast<int>(std::min<int64_t>(kMaxRowGroupsPerPass, RGT - rg0)), pp.data(), vp.data(), pairs, H,
                    RGT, rg0, accT.data());
      alignas(64) float mx_s[16], sum_s[16];
      for (int64_t rg = 0; rg < RGT; ++rg) {
        _mm512_store_ps(mx_s, mx[rg]);
        _mm512_store_ps(sum_s, sum[rg]);
        for (int64_t lane = 0; lane < 16 && rg * 16 + lane < M; ++lane) {
          const int64_t m = rg * 16 + lane;
          const int64_t row = (c * n + m / g) * num_heads + kvh * g + m % g;
          part_max[row] = mx_s[lane];
          part_sum[row] = sum_s[lane];
          float* dst = part_acc.data() + row * H;
          for (int64_t d = 0; d < H; ++d) dst[d] = accT[(d * RGT + rg) * 16 + lane];
        }
      }
    }
  });

  // merge the chunks of each row in order
  const int64_t rows = n * num_heads, hv = H / 16;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float m = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part_max[c * rows + r]);
      float total = 0.f;
      __m512 acc[kDecodeAttentionMaxHeadDim / 16];
      for (int64_t d = 0; d < hv; ++d) acc[d] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const float w = std::exp(part_max[c * rows + r] - m);
        total += w * part_sum[c * rows + r];
        const __m512 wv = _mm512_set1_ps(w);
        const float* src = part_acc.data() + (c * rows + r) * H;
        for (int64_t d = 0; d < hv; ++d) acc[d] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(src + d * 16), acc[d]);
      }
      const __m512 tv = _mm512_set1_ps(total);
      for (int64_t d = 0; d < hv; ++d) _mm512_storeu_ps(out_p + r * H + d * 16, _mm512_div_ps(acc[d], tv));
      lse_p[r] = m + std::log(total);
    }
  });
  return {out, lse};
}

// (out_a·e^(lse_a - m) + out_b·e^(lse_b - m)) / (e^(lse_a - m) + e^(lse_b - m)), m = max(lse_a, lse_b),
// in fp32 per row of H; a part with lse -inf has no weight, both -inf give 0 (lse -inf).
// out_* [..., H] fp32, lse_* [...] fp32. Returns (out in out_dtype, merged lse fp32).
std::tuple<at::Tensor, at::Tensor> merge_attention_states(at::Tensor out_a, at::Tensor lse_a, at::Tensor out_b,
                                                          at::Tensor lse_b, at::ScalarType out_dtype) {
  TORCH_CHECK(out_a.scalar_type() == at::kFloat && out_b.scalar_type() == at::kFloat && lse_a.scalar_type() == at::kFloat &&
                  lse_b.scalar_type() == at::kFloat,
              "merge_attention_states: fp32 parts");
  TORCH_CHECK(out_a.sizes() == out_b.sizes() && lse_a.sizes() == lse_b.sizes() && out_a.dim() == lse_a.dim() + 1 &&
                  out_a.sizes().slice(0, lse_a.dim()) == lse_a.sizes(),
              "merge_attention_states: out [..., H] and lse [...] of the same rows");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "merge_attention_states: fp32 or bf16 output");
  TORCH_CHECK(out_a.dim() >= 1 && out_a.size(-1) % 16 == 0, "merge_attention_states: H must be a multiple of 16");
  out_a = out_a.contiguous();
  out_b = out_b.contiguous();
  lse_a = lse_a.contiguous();
  lse_b = lse_b.contiguous();
  const int64_t H = out_a.size(-1), rows = lse_a.numel();
  auto out = at::empty(out_a.sizes(), out_a.options().dtype(out_dtype));
  auto lse = at::empty(lse_a.sizes(), lse_a.options());
  const float *oa = out_a.data_ptr<float>(), *ob = out_b.data_ptr<float>();
  const float *la = lse_a.data_ptr<float>(), *lb = lse_b.data_ptr<float>();
  float* lo = lse.data_ptr<float>();
  const bool bf16 = out_dtype == at::kBFloat16;
  float* dst_f32 = bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* dst_bf16 = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      merge_attention_row(oa + r * H, la[r], ob + r * H, lb[r], H, bf16 ? nullptr : dst_f32 + r * H,
                          bf16 ? dst_bf16 + r * H : nullptr, lo + r);
  });
  return {out, lse};
}

void merge_attention_row(const float* xa, float a, const float* xb, float b, int64_t H, float* dst_f32,
                         at::BFloat16* dst_bf16, float* lse_out) {
  const float m = std::max(a, b);
  float wa = 0.f, wb = 0.f;
  if (m != -INFINITY) {
    wa = std::exp(a - m);  // e^-inf = 0
    wb = std::exp(b - m);
  }
  const float total = wa + wb;
  const float inv = total > 0.f ? 1.f / total : 0.f;
  *lse_out = total > 0.f ? m + std::log(total) : -INFINITY;
  const float ca = wa * inv, cb = wb * inv;
  const __m512 cav = _mm512_set1_ps(ca), cbv = _mm512_set1_ps(cb);
  // a part without weight adds nothing, even where its output is not finite; each 16 features
  // are read before they are written, so dst may be xa
  for (int64_t d = 0; d < H; d += 16) {
    __m512 v = _mm512_setzero_ps();
    if (ca != 0.f) v = _mm512_mul_ps(cav, _mm512_loadu_ps(xa + d));
    if (cb != 0.f) v = _mm512_fmadd_ps(cbv, _mm512_loadu_ps(xb + d), v);
    if (dst_bf16) store16(dst_bf16 + d, v);
    else _mm512_storeu_ps(dst_f32 + d, v);
  }
}
