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

// 8 features of a pool row in fp32 (bf16 exact; int8 codes exact)
inline __m256 widen8(const void* row, int64_t d, bool int8) {
  if (int8) {
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(row) + d));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
  }
  return simd::load8(static_cast<const uint16_t*>(row) + d);
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

  // the query rows of each KV head, transposed in row groups: qt[kvh][rg][d][lane]
  std::vector<float> qt(static_cast<size_t>(nkv * RGT * H * 8), 0.f);
  for (int64_t kvh = 0; kvh < nkv; ++kvh)
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* row = a.q + ((m / g) * num_heads + kvh * g + m % g) * H;
      float* dst = qt.data() + ((kvh * RGT + m / 8) * H) * 8 + m % 8;
      for (int64_t d = 0; d < H; ++d) dst[d * 8] = simd::bf16_to_f32(row[d]);
    }

  // per chunk: unnormalised output [n, N_q, H], row max and Σ e^(s - max) [n, N_q]
  std::vector<float> part_acc(static_cast<size_t>(chunks * rows * H));
  std::vector<float> part_max(static_cast<size_t>(chunks * rows)), part_sum(static_cast<size_t>(chunks * rows));
  const int64_t tasks = nkv * chunks;

#pragma omp parallel if (tasks > 1 || rows > 64)
  {
    std::vector<float> kf, vf, sc, pr, accT, kpos, vpos, mxs, sums;
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
      // softmax lane-wise over positions: max, e^(s - max) (Σ in fp32), P in bf16
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
          if (a.int8) e = _mm256_mul_ps(e, _mm256_set1_ps(vpos[s]));  // the V scale weights the probability
          _mm256_storeu_ps(pr.data() + (s * RGT + rg) * 8, simd::round_bf16(e));
        }
        _mm256_storeu_ps(mxs.data() + rg * 8, m);
        _mm256_storeu_ps(sums.data() + rg * 8, total);
      }
      // PV, transposed: accT[d][rg][lane]
      accT.resize(H * RGT * 8);
      rg0 = 0;
      for (; rg0 + 2 <= RGT; rg0 += 2) chunk_values<2, 4>(pr.data(), vf.data(), S, S_pad, H, RGT, rg0, accT.data());
      if (rg0 < RGT) chunk_values<1, 8>(pr.data(), vf.data(), S, S_pad, H, RGT, rg0, accT.data());
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
