// Shared-prefix decode attention, torch-free (shared_prefix_attention.h states the contract).
//
// Layout: the M = n·g query rows of one KV head (row m = b·g + j: head kvh·g + j of request b)
// are packed once, transposed in fp32 "row groups" of 8 rows: qt[kvh][rg][d][lane] = q of row
// 8·rg + lane, feature d (padding rows zero). A task (KV head, chunk of kChunk positions) widens
// its chunk's K rows to fp32 once (kf[s][d]) and its V rows into blocks of 8 features
// (vf[d/8][s][d%8]), then:
//   scores  sc[s][rg] (8 rows per vector) += qt[rg][d] · broadcast(kf[s][d]), d in order, for
//           blocks of 2 row groups × 4 positions (1 × 8) whose 8 accumulators stay in registers;
//   softmax lane-wise over the chunk's positions: max, e^(s - max), Σ in fp32, P to bf16;
//   values  accT[d][rg] += P[s][rg] · broadcast(vf[s][d]), s in order, for blocks of 2 row
//           groups × 4 features (1 × 8).
// Every lane sees the same operations in the same order whatever the other rows, and rows
// never mix across lanes: a row's bits depend on its query, the prefix and prefix_len only.
// Each task leaves its rows' (acc, max, Σ); a second pass merges the chunks of each row in order.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "shared_prefix_attention.h"

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace shared_prefix {
namespace {

// sc[(s·RGT + rg)·8 + lane] = (q·k_s)·(pos_scale ? pos_scale[s] : scale), row groups rg0 .. rg0 + RB
template <int RB, int P>
void chunk_scores(const float* qt, const float* kf, int64_t S_pad, int64_t H, int64_t RGT, int64_t rg0, float scale,
                  const float* pos_scale, float* sc) {
  static_assert(RB * P == 8, "8 accumulators");
  for (int64_t s0 = 0; s0 < S_pad; s0 += P) {
    __m256 acc[P][RB];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 2
      for (int r = 0; r < RB; ++r) acc[p][r] = _mm256_setzero_ps();
    const float* k0 = kf + s0 * H;
    for (int64_t d = 0; d < H; ++d) {
      __m256 qv[RB];
#pragma GCC unroll 2
      for (int r = 0; r < RB; ++r) qv[r] = _mm256_loadu_ps(qt + ((rg0 + r) * H + d) * 8);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const __m256 kb = _mm256_broadcast_ss(k0 + p * H + d);
#pragma GCC unroll 2
        for (int r = 0; r < RB; ++r) acc[p][r] = _mm256_fmadd_ps(qv[r], kb, acc[p][r]);
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const __m256 m = _mm256_set1_ps(pos_scale ? pos_scale[s0 + p] : scale);
#pragma GCC unroll 2
      for (int r = 0; r < RB; ++r) _mm256_storeu_ps(sc + ((s0 + p) * RGT + rg0 + r) * 8, _mm256_mul_ps(acc[p][r], m));
    }
  }
}

// accT[(d·RGT + rg)·8 + lane] = Σ_s pr[s][rg] · vf[s][d] for row groups rg0 .. rg0 + RB
template <int RB, int D>
void chunk_values(const float* pr, const float* vf, int64_t S, int64_t S_pad, int64_t H, int64_t RGT, int64_t rg0,
                  float* accT) {
  static_assert(RB * D == 8 && D <= 8, "8 accumulators within one block of 8 features");
  for (int64_t d0 = 0; d0 < H; d0 += D) {
    const float* vb = vf + (d0 / 8) * S_pad * 8 + d0 % 8;
    __m256 acc[D][RB];
#pragma GCC unroll 8
    for (int k = 0; k < D; ++k)
#pragma GCC unroll 2
      for (int r = 0; r < RB; ++r) acc[k][r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      __m256 pv[RB];
#pragma GCC unroll 2
      for (int r = 0; r < RB; ++r) pv[r] = _mm256_loadu_ps(pr + (s * RGT + rg0 + r) * 8);
#pragma GCC unroll 8
      for (int k = 0; k < D; ++k) {
        const __m256 v = _mm256_broadcast_ss(vb + s * 8 + k);
#pragma GCC unroll 2
        for (int r = 0; r < RB; ++r) acc[k][r] = _mm256_fmadd_ps(pv[r], v, acc[k][r]);
      }
    }
#pragma GCC unroll 8
    for (int k = 0; k < D; ++k)
#pragma GCC unroll 2
      for (int r = 0; r < RB; ++r) _mm256_storeu_ps(accT + ((d0 + k) * RGT + rg0 + r) * 8, acc[k][r]);
  }
}

// The bf16 pair-dot levels (simd::kBf16Dot): the same sums, one VDPBF16PS per pair.
//   scores  sc[s][rg] += qp[rg][dp] · broadcast(k_s pair dp): qp holds each row's feature pairs
//           as stored (32-bit lanes), K rows are read as bf16 where they are;
//   values  accT[d][rg] += pp[s/2][rg] · broadcast(v pair (s, s+1) at d): pp pairs two
//           positions' probabilities per lane, V is packed per chunk as pairs of positions.

// sc as chunk_scores, with qp[(rg·H/2 + dp)·8 + lane] and k_rows[s] (bf16, padding repeats a live row)
template <int RB, int P>
void chunk_scores_pairs(const uint32_t* qp, const uint16_t* const* k_rows, int64_t S_pad, int64_t H, int64_t RGT,
                        int64_t rg0, float scale, const float* pos_scale, float* sc) {
  const int64_t HP = H / 2;
  for (int64_t s0 = 0; s0 < S_pad; s0 += P) {
    __m256 acc[P][RB];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) acc[p][r] = _mm256_setzero_ps();
    for (int64_t dp = 0; dp < HP; ++dp) {
      __m256i qv[RB];
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) qv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + ((rg0 + r) * HP + dp) * 8));
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const __m256i kb = simd::bcast_pair(k_rows[s0 + p] + 2 * dp);
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) acc[p][r] = simd::dot2_bf16(acc[p][r], qv[r], kb);
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const __m256 m = _mm256_set1_ps(pos_scale ? pos_scale[s0 + p] : scale);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) _mm256_storeu_ps(sc + ((s0 + p) * RGT + rg0 + r) * 8, _mm256_mul_ps(acc[p][r], m));
    }
  }
}

// accT as chunk_values, with pp[(s/2·RGT + rg)·8 + lane] (bf16 pairs) and vp[(s/2)·H + d] (bf16 pairs)
template <int RB, int D>
void chunk_values_pairs(const uint32_t* pp, const uint32_t* vp, int64_t S, int64_t H, int64_t RGT, int64_t rg0, float* accT) {
  for (int64_t d0 = 0; d0 < H; d0 += D) {
    __m256 acc[D][RB];
#pragma GCC unroll 8
    for (int k = 0; k < D; ++k)
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) acc[k][r] = _mm256_setzero_ps();
    for (int64_t sp = 0; sp < (S + 1) / 2; ++sp) {
      __m256i pv[RB];
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) pv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pp + (sp * RGT + rg0 + r) * 8));
#pragma GCC unroll 8
      for (int k = 0; k < D; ++k) {
        const __m256i v = _mm256_set1_epi32(static_cast<int>(vp[sp * H + d0 + k]));
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r) acc[k][r] = simd::dot2_bf16(acc[k][r], pv[r], v);
      }
    }
#pragma GCC unroll 8
    for (int k = 0; k < D; ++k)
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) _mm256_storeu_ps(accT + ((d0 + k) * RGT + rg0 + r) * 8, acc[k][r]);
  }
}

// 8 features of a pool row in fp32 (bf16 exact; int8 codes exact)
inline __m256 widen8(const void* row, int64_t d, bool int8) {
  if (int8) {
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(row) + d));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
  }
  return simd::load8(static_cast<const uint16_t*>(row) + d);
}

// The chunk's softmax lane-wise over its S positions, each lane a query row: max, e^(s - max)
// (Σ in fp32), P = e (int8: times the position's V scale, which weights the probability)
// rounded to bf16, into pr [S_pad][RGT][8]; each lane's max and Σ into mxs, sums [RGT][8].
// softcap > 0: the S positions' scores capped in place first (simd::softcap8, Gemma 2).
void lanewise_softmax(std::vector<float>& sc, int64_t S, int64_t S_pad, int64_t RGT, const float* v_scale, float softcap,
                      std::vector<float>& pr, std::vector<float>& mxs, std::vector<float>& sums) {
  if (softcap > 0.f) {
    const __m256 c = _mm256_set1_ps(softcap), inv = _mm256_set1_ps(1.f / softcap);
    for (int64_t i = 0; i < S * RGT; ++i)
      _mm256_storeu_ps(sc.data() + i * 8, simd::softcap8(_mm256_loadu_ps(sc.data() + i * 8), c, inv));
  }
  pr.resize(S_pad * RGT * 8);
  mxs.resize(RGT * 8);
  sums.resize(RGT * 8);
  for (int64_t rg = 0; rg < RGT; ++rg) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int64_t s = 0; s < S; ++s) m = _mm256_max_ps(m, _mm256_loadu_ps(sc.data() + (s * RGT + rg) * 8));
    __m256 total = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      __m256 e = simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(sc.data() + (s * RGT + rg) * 8), m));
      total = _mm256_add_ps(total, e);
      if (v_scale) e = _mm256_mul_ps(e, _mm256_set1_ps(v_scale[s]));
      _mm256_storeu_ps(pr.data() + (s * RGT + rg) * 8, simd::round_bf16(e));
    }
    _mm256_storeu_ps(mxs.data() + rg * 8, m);
    _mm256_storeu_ps(sums.data() + rg * 8, total);
  }
}

// One task's chunk at the pair levels: positions [p0, p0 + S) of KV head kvh for every row group:
// scores, the lane-wise softmax (as the 8-lane path: max, e^(s - max), Σ, P to bf16), values.
void pair_chunk(const Args& a, int64_t kvh, int64_t p0, int64_t S, int64_t S_pad, int64_t RGT, const uint32_t* qk,
                std::vector<uint16_t>& kbf, std::vector<const uint16_t*>& krow, std::vector<uint32_t>& vpairs,
                std::vector<float>& kpos, std::vector<float>& vpos, std::vector<float>& sc, std::vector<float>& pr,
                std::vector<uint32_t>& pp, std::vector<float>& mxs, std::vector<float>& sums, std::vector<float>& accT) {
  const int64_t nkv = a.num_kv_heads, H = a.head_dim, slot_stride = nkv * H, elem = a.int8 ? 1 : 2;
  const char* kd = static_cast<const char*>(a.k_pool);
  const char* vd = static_cast<const char*>(a.v_pool);
  auto slot_of = [&](int64_t pos) {
    return static_cast<int64_t>(a.blocks[pos / a.block_size]) * a.block_size + pos % a.block_size;
  };
  auto row_at = [&](const char* pool, int64_t pos) { return pool + (slot_of(pos) * slot_stride + kvh * H) * elem; };
  // K rows: bf16 in place; int8 codes as the bf16 of the same integer (exact). Padding repeats p0.
  krow.resize(S_pad);
  kpos.resize(S_pad);
  if (a.int8) kbf.resize(S_pad * H);
  for (int64_t s = 0; s < S_pad; ++s) {
    const int64_t pos = p0 + (s < S ? s : 0);
    const char* row = row_at(kd, pos);
    if (a.int8) {
      uint16_t* dst = kbf.data() + s * H;
      for (int64_t d = 0; d < H; d += 8) simd::store8(dst + d, widen8(row, d, true));
      krow[s] = dst;
      kpos[s] = a.k_scale[slot_of(pos) * nkv + kvh] * a.scale;
    } else {
      krow[s] = reinterpret_cast<const uint16_t*>(row);
    }
  }
  sc.resize(S_pad * RGT * 8);
  const float* ps = a.int8 ? kpos.data() : nullptr;
  int64_t rg0 = 0;
  for (; rg0 + 2 <= RGT; rg0 += 2) chunk_scores_pairs<2, 8>(qk, krow.data(), S_pad, H, RGT, rg0, a.scale, ps, sc.data());
  if (rg0 < RGT) chunk_scores_pairs<1, 8>(qk, krow.data(), S_pad, H, RGT, rg0, a.scale, ps, sc.data());
  // V in pairs of positions, zero past S
  const int64_t SP = (S + 1) / 2;
  vpairs.assign(SP * H, 0u);
  vpos.assign(S_pad, 0.f);
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t s = 0; s < S; ++s) {
    const char* row = row_at(vd, p0 + s);
    uint32_t* dst = vpairs.data() + (s / 2) * H;
    for (int64_t d = 0; d < H; d += 8) {
      // the position's 8 values as bf16 in the low (even s) or high (odd s) half of each word
      __m256i bits = _mm256_castps_si256(simd::round_bf16(widen8(row, d, a.int8)));  // exact: bf16 or int8 values
      __m256i cur = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dst + d));
      cur = s % 2 ? _mm256_or_si256(cur, _mm256_and_si256(bits, hi_mask)) : _mm256_srli_epi32(bits, 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), cur);
    }
    if (a.int8) vpos[s] = a.v_scale[slot_of(p0 + s) * nkv + kvh];
  }
  lanewise_softmax(sc, S, S_pad, RGT, a.int8 ? vpos.data() : nullptr, a.softcap, pr, mxs, sums);
  // P in pairs of positions (bf16 p_s low, p_{s+1} high; 0 past S)
  pp.resize(SP * RGT * 8);
  for (int64_t sp = 0; sp < SP; ++sp)
    for (int64_t rg = 0; rg < RGT; ++rg) {
      const __m256i e0 = _mm256_castps_si256(_mm256_loadu_ps(pr.data() + (2 * sp * RGT + rg) * 8));
      const __m256i e1 = 2 * sp + 1 < S ? _mm256_castps_si256(_mm256_loadu_ps(pr.data() + ((2 * sp + 1) * RGT + rg) * 8))
                                        : _mm256_setzero_si256();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp.data() + (sp * RGT + rg) * 8),
                          _mm256_or_si256(_mm256_srli_epi32(e0, 16), _mm256_and_si256(e1, hi_mask)));
    }
  accT.resize(H * RGT * 8);
  rg0 = 0;
  for (; rg0 + 2 <= RGT; rg0 += 2) chunk_values_pairs<2, 8>(pp.data(), vpairs.data(), S, H, RGT, rg0, accT.data());
  if (rg0 < RGT) chunk_values_pairs<1, 8>(pp.data(), vpairs.data(), S, H, RGT, rg0, accT.data());
}

}  // namespace

void shared_prefix_attention(const Args& a) {
  const int64_t n = a.n, num_heads = a.num_heads, nkv = a.num_kv_heads, H = a.head_dim;
  const int64_t rows = n * num_heads;
  if (rows == 0) return;
  if (a.prefix_len <= 0) {
    std::memset(a.out, 0, sizeof(float) * rows * H);
    for (int64_t r = 0; r < rows; ++r) a.lse[r] = -INFINITY;
    return;
  }
  const int64_t g = num_heads / nkv;
  const int64_t M = n * g;            // query rows per KV head
  const int64_t RGT = (M + 7) / 8;    // row groups of 8
  const int64_t chunks = (a.prefix_len + kChunk - 1) / kChunk;
  const int64_t slot_stride = nkv * H;
  const int64_t elem = a.int8 ? 1 : 2;
  const char* kd = static_cast<const char*>(a.k_pool);
  const char* vd = static_cast<const char*>(a.v_pool);

  // the query rows of each KV head, transposed in row groups: qt[kvh][rg][d][lane] (fp32), or
  // at the pair levels qt's words as qp[kvh][rg][d/2][lane] (a feature pair as stored)
  constexpr bool kPairs = simd::kBf16Dot;
  std::vector<float> qt(static_cast<size_t>(nkv * RGT * H * 8), 0.f);
  uint32_t* qp = reinterpret_cast<uint32_t*>(qt.data());
  for (int64_t kvh = 0; kvh < nkv; ++kvh)
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* row = a.q + ((m / g) * num_heads + kvh * g + m % g) * H;
      if constexpr (kPairs) {
        uint32_t* dst = qp + ((kvh * RGT + m / 8) * (H / 2)) * 8 + m % 8;
        for (int64_t dp = 0; dp < H / 2; ++dp) std::memcpy(dst + dp * 8, row + 2 * dp, 4);
      } else {
        float* dst = qt.data() + ((kvh * RGT + m / 8) * H) * 8 + m % 8;
        for (int64_t d = 0; d < H; ++d) dst[d * 8] = simd::bf16_to_f32(row[d]);
      }
    }

  // per chunk: unnormalised output [n, N_q, H], row max and Σ e^(s - max) [n, N_q]
  std::vector<float> part_acc(static_cast<size_t>(chunks * rows * H));
  std::vector<float> part_max(static_cast<size_t>(chunks * rows)), part_sum(static_cast<size_t>(chunks * rows));
  const int64_t tasks = nkv * chunks;

#pragma omp parallel if (tasks > 1 || rows > 64)
  {
    std::vector<float> kf, vf, sc, pr, accT, kpos, vpos, mxs, sums;
    std::vector<uint16_t> kbf;                // int8 K rows as bf16 (pair levels)
    std::vector<const uint16_t*> krow;        // the chunk's K rows (pair levels)
    std::vector<uint32_t> vpairs, pp;         // V and P in pairs of positions (pair levels)
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t kvh = task / chunks, c = task % chunks;
      const int64_t p0 = c * kChunk, S = std::min(kChunk, a.prefix_len - p0);
      const int64_t S_pad = (S + 7) / 8 * 8;
      auto slot_of = [&](int64_t pos) {
        return static_cast<int64_t>(a.blocks[pos / a.block_size]) * a.block_size + pos % a.block_size;
      };
      auto row_at = [&](const char* pool, int64_t pos) { return pool + (slot_of(pos) * slot_stride + kvh * H) * elem; };
      auto prefetch = [&](const char* pool, int64_t pos) {
        const char* r = row_at(pool, pos);
        for (int64_t byte = 0; byte < H * elem; byte += 64) _mm_prefetch(r + byte, _MM_HINT_T0);
      };
      if constexpr (kPairs) {
        pair_chunk(a, kvh, p0, S, S_pad, RGT, qp + kvh * RGT * (H / 2) * 8, kbf, krow, vpairs, kpos, vpos, sc, pr, pp,
                   mxs, sums, accT);
      } else {
      // K rows widened (padding repeats position p0: its scores are never used)
      kf.resize(S_pad * H);
      kpos.resize(S_pad);
      for (int64_t s = 0; s < S_pad; ++s) {
        if (s + 8 < S) prefetch(kd, p0 + s + 8);
        const int64_t pos = p0 + (s < S ? s : 0);
        const char* row = row_at(kd, pos);
        for (int64_t d = 0; d < H; d += 8) _mm256_storeu_ps(kf.data() + s * H + d, widen8(row, d, a.int8));
        if (a.int8) kpos[s] = a.k_scale[slot_of(pos) * nkv + kvh] * a.scale;
      }
      // scores of every row group
      sc.resize(S_pad * RGT * 8);
      const float* qk = qt.data() + kvh * RGT * H * 8;
      const float* ps = a.int8 ? kpos.data() : nullptr;
      int64_t rg0 = 0;
      for (; rg0 + 2 <= RGT; rg0 += 2) chunk_scores<2, 4>(qk, kf.data(), S_pad, H, RGT, rg0, a.scale, ps, sc.data());
      if (rg0 < RGT) chunk_scores<1, 8>(qk, kf.data(), S_pad, H, RGT, rg0, a.scale, ps, sc.data());
      // V rows widened into blocks of 8 features, zero past S
      vf.assign(S_pad * H, 0.f);
      vpos.assign(S_pad, 0.f);
      for (int64_t s = 0; s < S; ++s) {
        if (s + 8 < S) prefetch(vd, p0 + s + 8);
        const char* row = row_at(vd, p0 + s);
        for (int64_t d = 0; d < H; d += 8) _mm256_storeu_ps(vf.data() + ((d / 8) * S_pad + s) * 8, widen8(row, d, a.int8));
        if (a.int8) vpos[s] = a.v_scale[slot_of(p0 + s) * nkv + kvh];
      }
      lanewise_softmax(sc, S, S_pad, RGT, a.int8 ? vpos.data() : nullptr, a.softcap, pr, mxs, sums);
      // PV, transposed: accT[d][rg][lane]
      accT.resize(H * RGT * 8);
      rg0 = 0;
      for (; rg0 + 2 <= RGT; rg0 += 2) chunk_values<2, 4>(pr.data(), vf.data(), S, S_pad, H, RGT, rg0, accT.data());
      if (rg0 < RGT) chunk_values<1, 8>(pr.data(), vf.data(), S, S_pad, H, RGT, rg0, accT.data());
      }
      for (int64_t rg = 0; rg < RGT; ++rg) {
        const float* mx_s = mxs.data() + rg * 8;
        const float* sum_s = sums.data() + rg * 8;
        for (int64_t lane = 0; lane < 8 && rg * 8 + lane < M; ++lane) {
          const int64_t m = rg * 8 + lane;
          const int64_t row = (c * n + m / g) * num_heads + kvh * g + m % g;
          part_max[row] = mx_s[lane];
          part_sum[row] = sum_s[lane];
          float* dst = part_acc.data() + row * H;
          for (int64_t d = 0; d < H; ++d) dst[d] = accT[(d * RGT + rg) * 8 + lane];
        }
      }
    }
    // the chunks of each row merged in order
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float m = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part_max[c * rows + r]);
      float total = 0.f;
      __m256 acc[kMaxHeadDim / 8];
      for (int64_t d = 0; d < H / 8; ++d) acc[d] = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const float w = std::exp(part_max[c * rows + r] - m);
        total += w * part_sum[c * rows + r];
        const __m256 wv = _mm256_set1_ps(w);
        const float* src = part_acc.data() + (c * rows + r) * H;
        for (int64_t d = 0; d < H / 8; ++d) acc[d] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(src + d * 8), acc[d]);
      }
      const __m256 tv = _mm256_set1_ps(total);
      for (int64_t d = 0; d < H / 8; ++d) _mm256_storeu_ps(a.out + r * H + d * 8, _mm256_div_ps(acc[d], tv));
      a.lse[r] = m + std::log(total);
    }
  }
}

void merge_attention_row(const float* xa, float la, const float* xb, float lb, int64_t H, float* dst_f32,
                         uint16_t* dst_bf16, float* lse_out) {
  const float m = std::max(la, lb);
  float wa = 0.f, wb = 0.f;
  if (m != -INFINITY) {
    wa = std::exp(la - m);  // e^-inf = 0
    wb = std::exp(lb - m);
  }
  const float total = wa + wb;
  const float inv = total > 0.f ? 1.f / total : 0.f;
  *lse_out = total > 0.f ? m + std::log(total) : -INFINITY;
  const float ca = wa * inv, cb = wb * inv;
  const __m256 cav = _mm256_set1_ps(ca), cbv = _mm256_set1_ps(cb);
  // a part without weight adds nothing, even where its output is not finite; each 8 features
  // are read before they are written, so dst may be xa
  for (int64_t d = 0; d < H; d += 8) {
    __m256 v = _mm256_setzero_ps();
    if (ca != 0.f) v = _mm256_mul_ps(cav, _mm256_loadu_ps(xa + d));
    if (cb != 0.f) v = _mm256_fmadd_ps(cbv, _mm256_loadu_ps(xb + d), v);
    if (dst_bf16) simd::store8(dst_bf16 + d, v);
    else simd::store8(dst_f32 + d, v);
  }
}

void merge_attention_states(const float* xa, const float* la, const float* xb, const float* lb, int64_t rows,
                            int64_t H, float* dst_f32, uint16_t* dst_bf16, float* lse_out) {
#pragma omp parallel for schedule(static) if (rows > 64)
  for (int64_t r = 0; r < rows; ++r)
    merge_attention_row(xa + r * H, la[r], xb + r * H, lb[r], H, dst_bf16 ? nullptr : dst_f32 + r * H,
                        dst_bf16 ? dst_bf16 + r * H : nullptr, lse_out + r);
}

}  // namespace shared_prefix
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
