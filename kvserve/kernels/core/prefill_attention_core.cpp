// paged_prefill_attention's core (prefill_attention.h) on 8 fp32 lanes. Named *_core.cpp: torch's
// extension build names objects by basename, so it may not share ops/prefill_attention.cpp's.
//
// Two phases:
//   1. per (segment, KV head), its context's K and V are packed once out of the pool, as bf16
//      (an int8 pool's values as the bf16 of the same integer: exact, |q| <= 127):
//        K as [group of 16 keys][head_dim][16 keys], so two vectors of 8 scores are a
//          broadcast query feature times the two halves of one packed row, no horizontal sums;
//        V as [key][head_dim], one row per key;
//      each packed row of 16 interleaved (element 2i = i, 2i + 1 = 8 + i), so that one load, a
//      shift and a mask widen it to two fp32 vectors.
//      Keys past the context (up to a multiple of 32) are zero. int8 pools keep their keys'
//      K and V scales beside them ([ctx rounded up to 32], zero past ctx). A member of a shared
//      prefix packs only its positions from shared_len on; block b of its keys comes from its
//      leader's packed K/V while b·32 < shared_len (a multiple of 64), the same values.
//   2. per (segment, KV head, tile of kTileRows query rows): the rows are the segment's
//      (position, query head of this KV head's group) pairs, position-major, so a tile holds
//      the g heads of neighbouring positions. For each block of 32 keys up to the tile's last
//      position: S = Q·Kᵀ (fp32, features summed in order), an online softmax step per row
//      (running max, rescale), P (bf16-rounded) · V accumulated into O in fp32; at the end
//      O / l, rounded to bf16.
//
// Row invariance: blocks sit at fixed key positions (multiples of 32 from the context's first
// position), and a row's arithmetic in a block depends only on that block and the row: its
// scores (one FMA chain over the features), its masked softmax step (a non-inlined function,
// the same code for every tile size), its P·V (one FMA chain per feature over the block's keys
// in order). What a tile adds for a row beyond its own position is exactly nothing: a block the
// row cannot see is skipped for it (no max change, zero probabilities), keys past its position
// in a block it sees have probability 0 (adding 0·v), and a rescale by 1 is exact. So a row's
// bits are the same whatever tile, chunk (S0, m) or call it is computed in.
#include "prefill_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "simd.h"

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace {

constexpr int kTileRows = 6;       // query rows per tile: 6 rows × 16 keys (or 16 features) of accumulators
constexpr int64_t kBlockKeys = 32;  // keys per online-softmax step
constexpr int64_t kGroupKeys = 16;  // keys per packed K group (two vectors of scores)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// 16 bf16 stored interleaved (element 2i = value i, element 2i + 1 = value 8 + i) → values
// 0..7 and 8..15 as fp32: one load, a shift and a mask (the packed layouts below use it).
inline void load16_interleaved(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  hi = _mm256_and_ps(_mm256_castsi256_ps(raw), _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// a and b (8 bf16 each) → the interleaved 16 at p
inline void store16_interleaved(uint16_t* p, __m128i a, __m128i b) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_unpacklo_epi16(a, b));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm_unpackhi_epi16(a, b));
}

// the 8×8 transpose of 16-bit elements: t[j] = (r[0][j], ..., r[7][j])
inline void transpose8x8(const __m128i r[8], __m128i t[8]) {
  const __m128i a0 = _mm_unpacklo_epi16(r[0], r[1]), a1 = _mm_unpackhi_epi16(r[0], r[1]);
  const __m128i a2 = _mm_unpacklo_epi16(r[2], r[3]), a3 = _mm_unpackhi_epi16(r[2], r[3]);
  const __m128i a4 = _mm_unpacklo_epi16(r[4], r[5]), a5 = _mm_unpackhi_epi16(r[4], r[5]);
  const __m128i a6 = _mm_unpacklo_epi16(r[6], r[7]), a7 = _mm_unpackhi_epi16(r[6], r[7]);
  const __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
  const __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
  const __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
  const __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
  t[0] = _mm_unpacklo_epi64(b0, b4);
  t[1] = _mm_unpackhi_epi64(b0, b4);
  t[2] = _mm_unpacklo_epi64(b1, b5);
  t[3] = _mm_unpackhi_epi64(b1, b5);
  t[4] = _mm_unpacklo_epi64(b2, b6);
  t[5] = _mm_unpackhi_epi64(b2, b6);
  t[6] = _mm_unpacklo_epi64(b3, b7);
  t[7] = _mm_unpackhi_epi64(b3, b7);
}

// D int8 → their bf16 (exact: |v| <= 128 fits bf16's 8 significant bits)
inline void int8_row_to_bf16(const int8_t* src, int64_t D, uint16_t* dst) {
  for (int64_t d = 0; d < D; d += 8) {
    const __m256i i32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)));
    const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(i32)), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                     _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
  }
}

// The K and V rows (bf16, D features) of one group of 16 keys (null: a key past the context,
// zeros) → K [D][16 keys] and V [16 keys][D], both interleaved in 16s (load16_interleaved):
// K's row d holds keys 0..7 and 8..15 of the group, V's row k features c..c+7 and c+8..c+15 of
// each chunk c of 16.
void pack_group(const uint16_t* const* k_rows, const uint16_t* const* v_rows, const uint16_t* zeros, int64_t D,
                uint16_t* k_out, uint16_t* v_out) {
  for (int64_t d0 = 0; d0 < D; d0 += 8) {
    __m128i r[8], lo[8], hi[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>((k_rows[i] ? k_rows[i] : zeros) + d0));
    transpose8x8(r, lo);
    for (int i = 0; i < 8; ++i)
      r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>((k_rows[8 + i] ? k_rows[8 + i] : zeros) + d0));
    transpose8x8(r, hi);
    for (int j = 0; j < 8; ++j) store16_interleaved(k_out + (d0 + j) * kGroupKeys, lo[j], hi[j]);
  }
  for (int k = 0; k < kGroupKeys; ++k) {
    const uint16_t* src = v_rows[k] ? v_rows[k] : zeros;
    for (int64_t c = 0; c < D; c += 16)
      store16_interleaved(v_out + k * D + c, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c)),
                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c + 8)));
  }
}

// the 8×8 transpose of 32-bit elements: t[j] = (r[0][j], ..., r[7][j])
inline void transpose8x8_epi32(const __m256i r[8], __m256i t[8]) {
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
  t[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
  t[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
  t[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
  t[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
  t[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  t[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  t[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  t[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// The pair layouts of the bf16 pair-dot levels (simd::kBf16Dot), for one group of 16 keys:
//   K [D/2 feature pairs][16 keys] of 32-bit (k[2i], k[2i + 1]) pairs: a score vector of 8 keys
//     is one VDPBF16PS of a broadcast query pair against half a row;
//   V [8 key pairs][D features] of 32-bit (v_first[f], v_second[f]) pairs: a vector of 8
//     features is one VDPBF16PS of a broadcast pair of probabilities.
// Same sizes and offsets per group as pack_group's layouts (a block of 32 keys at pos·D).
void pack_group_pairs(const uint16_t* const* k_rows, const uint16_t* const* v_rows, const uint16_t* zeros, int64_t D,
                      uint16_t* k_out, uint16_t* v_out) {
  for (int half = 0; half < 2; ++half)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m256i r[8], t[8];
      for (int i = 0; i < 8; ++i) {
        const uint16_t* row = k_rows[half * 8 + i];
        r[i] = simd::load16_bf16((row ? row : zeros) + d0);
      }
      transpose8x8_epi32(r, t);  // t[j]: pair d0/2 + j of keys 0..7 of this half
      for (int j = 0; j < 8; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(k_out + (d0 / 2 + j) * 2 * kGroupKeys + half * 16), t[j]);
    }
  for (int kp = 0; kp < kGroupKeys / 2; ++kp) {
    const uint16_t* a = v_rows[2 * kp] ? v_rows[2 * kp] : zeros;
    const uint16_t* b = v_rows[2 * kp + 1] ? v_rows[2 * kp + 1] : zeros;
    for (int64_t c = 0; c < D; c += 16) {
      // qwords 0, 2, 1, 3: the in-lane unpacks then give features c..c+7 and c+8..c+15 in order
      const __m256i x0 = _mm256_permute4x64_epi64(simd::load16_bf16(a + c), 0xd8);
      const __m256i x1 = _mm256_permute4x64_epi64(simd::load16_bf16(b + c), 0xd8);
      uint16_t* dst = v_out + kp * 2 * D + 2 * c;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_unpacklo_epi16(x0, x1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), _mm256_unpackhi_epi16(x0, x1));
    }
  }
}

// K and V of `count` keys (their slots) of one KV head → packed K [padded/16][D][16] and
// V [padded][D] (pack_group's layouts), zero past count (padded a multiple of 32). int8 pools:
// each value as the bf16 of its integer; `rows` is scratch for 32 rows of D.
template <typename T>
void pack_kv(const T* k_pool, const T* v_pool, int64_t row_elems, int64_t head, const int64_t* slots, int64_t count,
             int64_t padded, int64_t D, uint16_t* k_out, uint16_t* v_out, uint16_t* rows, const uint16_t* zeros) {
  for (int64_t g = 0; g < padded / kGroupKeys; ++g) {
    const uint16_t* k_rows[kGroupKeys];
    const uint16_t* v_rows[kGroupKeys];
    for (int i = 0; i < kGroupKeys; ++i) {
      const int64_t key = g * kGroupKeys + i;
      if (key >= count) {
        k_rows[i] = v_rows[i] = nullptr;
      } else if constexpr (sizeof(T) == 2) {
        k_rows[i] = reinterpret_cast<const uint16_t*>(k_pool) + slots[key] * row_elems + head * D;
        v_rows[i] = reinterpret_cast<const uint16_t*>(v_pool) + slots[key] * row_elems + head * D;
      } else {
        uint16_t* kr = rows + (2 * i) * D;
        uint16_t* vr = kr + D;
        int8_row_to_bf16(reinterpret_cast<const int8_t*>(k_pool) + slots[key] * row_elems + head * D, D, kr);
        int8_row_to_bf16(reinterpret_cast<const int8_t*>(v_pool) + slots[key] * row_elems + head * D, D, vr);
        k_rows[i] = kr;
        v_rows[i] = vr;
      }
    }
    if constexpr (simd::kBf16Dot) pack_group_pairs(k_rows, v_rows, zeros, D, k_out + g * kGroupKeys * D, v_out + g * kGroupKeys * D);
    else pack_group(k_rows, v_rows, zeros, D, k_out + g * kGroupKeys * D, v_out + g * kGroupKeys * D);
  }
}

// What a tile reads: the segment's packed K/V (the leader's for keys before shared_keys), its
// int8 scales (per context position, null for bf16 pools), the shapes.
struct KvView {
  const uint16_t* k_shared;
  const uint16_t* v_shared;
  const uint16_t* k_own;
  const uint16_t* v_own;
  int64_t shared_keys;
  const float* ks;
  const float* vs;
  int64_t D;
  float scale;
  float softcap;  // > 0: scores capped (Gemma 2), 0: none
};

// The running state of one query row.
struct RowState {
  float max;         // running maximum of the (K-scaled) scores seen, -inf before any
  float max_scaled;  // max · scale, as the exponent subtracts it
};

// One row's online-softmax step over a block of 32 keys, of which the first `visible` (1..32)
// are the row's: s its 32 scores (int8 pools: ks, vs the keys' K and V scales, else null),
// l its 8 lane sums (key k's exponential goes to lane k % 8, so the order of each sum is fixed
// by the key positions), p its 32 probabilities out (bf16-rounded, zero past visible). Returns
// the factor O and l are rescaled by (exactly 1 when the maximum did not change).
// Not inlined: every tile size runs this same code for its rows.
__attribute__((noinline)) float softmax_step(const float* s, int64_t visible, float scale, float softcap, const float* ks,
                                             const float* vs, RowState& st, float* l, float* p) {
  // with a softcap the scores are scaled and capped here (simd::softcap8), so the rest runs at scale 1
  const __m256 cap = _mm256_set1_ps(softcap), inv_cap = _mm256_set1_ps(softcap > 0.f ? 1.f / softcap : 0.f),
               pre = _mm256_set1_ps(scale);
  if (softcap > 0.f) scale = 1.f;
  const __m256i vis = _mm256_set1_epi32(static_cast<int>(visible));
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 sv[4], mask[4];
  __m256 mx = neg_inf;
  for (int j = 0; j < 4; ++j) {
    const __m256i idx = _mm256_setr_epi32(8 * j, 8 * j + 1, 8 * j + 2, 8 * j + 3, 8 * j + 4, 8 * j + 5, 8 * j + 6, 8 * j + 7);
    mask[j] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(vis, idx));
    sv[j] = simd::load8(s + 8 * j);
    if (ks) sv[j] = _mm256_mul_ps(sv[j], simd::load8(ks + 8 * j));
    if (softcap > 0.f) sv[j] = simd::softcap8(_mm256_mul_ps(sv[j], pre), cap, inv_cap);
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg_inf, sv[j], mask[j]));
  }
  const float block_max = simd::hmax8(mx);
  float corr = 1.f;
  if (block_max > st.max) {
    const float scaled = block_max * scale;
    if (st.max == -std::numeric_limits<float>::infinity()) {
      corr = 0.f;
    } else {
      const __m256 c = simd::exp8(_mm256_sub_ps(_mm256_set1_ps(st.max_scaled), _mm256_set1_ps(scaled)));
      corr = _mm256_cvtss_f32(c);
    }
    st.max = block_max;
    st.max_scaled = scaled;
  }
  const __m256 sc = _mm256_set1_ps(scale), ms = _mm256_set1_ps(st.max_scaled);
  __m256 lv = _mm256_fmadd_ps(simd::load8(l), _mm256_set1_ps(corr), _mm256_setzero_ps());
  for (int j = 0; j < 4; ++j) {
    const __m256 e = _mm256_and_ps(simd::exp8(_mm256_fmsub_ps(sv[j], sc, ms)), mask[j]);
    lv = _mm256_add_ps(lv, e);
    __m256 pr = e;
    if (vs) pr = _mm256_mul_ps(pr, simd::load8(vs + 8 * j));
    simd::store8(p + 8 * j, simd::round_bf16(pr));
  }
  simd::store8(l, lv);
  return corr;
}

// Per-thread scratch of a tile.
struct Scratch {
  std::vector<float> q, o, s, p, l;
  std::vector<uint16_t> pbf;  // the pair levels' probabilities as bf16
  explicit Scratch(int64_t D)
      : q(kTileRows * D), o(kTileRows * D), s(kTileRows * kBlockKeys), p(kTileRows * kBlockKeys), l(kTileRows * 8),
        pbf(kTileRows * kBlockKeys) {}
};

// S = Q·Kᵀ on the pair layout for R rows and the block's first `keys` keys: per (row, key), one
// VDPBF16PS chain over the feature pairs in order. A pass takes both groups of the block (4
// vectors a row) when the rows see past its first 16 keys; the scores of keys a row does not
// see are computed and masked by the softmax step, their value never used.
template <int R, int V>
inline void pair_scores_pass(const uint16_t* kg, const uint16_t* const* q_rows, int64_t D, float* s) {
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t dp = 0; dp < D / 2; ++dp) {
    __m256i x[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)  // group v / 2, keys 8·(v % 2) ..
      x[v] = simd::load16_bf16(kg + (v / 2) * kGroupKeys * D + dp * 2 * kGroupKeys + (v % 2) * 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i qp = simd::bcast_pair(q_rows[r] + 2 * dp);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = simd::dot2_bf16(acc[r][v], qp, x[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) simd::store8(s + r * kBlockKeys + 8 * v, acc[r][v]);
}

template <int R>
inline void pair_scores(const uint16_t* kb, const uint16_t* const* q_rows, int64_t keys, int64_t D, float* s) {
  if (keys > kGroupKeys) pair_scores_pass<R, 4>(kb, q_rows, D, s);
  else pair_scores_pass<R, 2>(kb, q_rows, D, s);
}

// O[c, c + 8V) += P·V on the pair layout for R rows and the block's first `keys` keys (in
// pairs; an odd last key pairs with one of probability 0): per (row, feature), one VDPBF16PS
// chain over the key pairs in order
template <int R, int V>
inline void pair_values(const uint16_t* vb, const uint16_t* pbf, int64_t keys, int64_t D, int64_t c, __m256 (&acc)[R][V]) {
  for (int64_t kp = 0; kp < (keys + 1) / 2; ++kp) {
    const uint16_t* row = vb + kp * 2 * D + 2 * c;
    __m256i x[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) x[v] = simd::load16_bf16(row + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i pp = simd::bcast_pair(pbf + r * kBlockKeys + 2 * kp);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = simd::dot2_bf16(acc[r][v], pp, x[v]);
    }
  }
}

// R query rows (row r: bf16 features at q_rows[r], sees keys [0, last[r]]) → out_rows[r].
template <int R>
void attend_tile(const KvView& kv, const uint16_t* const* q_rows, uint16_t* const* out_rows, const int64_t* last,
                 Scratch& w) {
  const int64_t D = kv.D;
  float* qf = w.q.data();
  float* o = w.o.data();
  float* s = w.s.data();
  float* p = w.p.data();
  float* l = w.l.data();
  uint16_t* pbf = w.pbf.data();
  RowState st[R];
  int64_t last_max = 0;
  for (int r = 0; r < R; ++r) {
    if constexpr (!simd::kBf16Dot)  // the pair levels read q as it is stored
      for (int64_t d = 0; d < D; d += 8) simd::store8(qf + r * D + d, simd::load8(q_rows[r] + d));
    std::fill(o + r * D, o + (r + 1) * D, 0.f);
    std::fill(l + r * 8, l + (r + 1) * 8, 0.f);
    st[r] = {-std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
    last_max = std::max(last_max, last[r]);
  }
  const int64_t blocks = last_max / kBlockKeys + 1;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t pos = b * kBlockKeys;
    const bool shared = pos < kv.shared_keys;
    const uint16_t* kb = shared ? kv.k_shared + pos * D : kv.k_own + (pos - kv.shared_keys) * D;
    const uint16_t* vb = shared ? kv.v_shared + pos * D : kv.v_own + (pos - kv.shared_keys) * D;
    const int64_t keys = std::min<int64_t>(kBlockKeys, last_max - pos + 1);  // the most any row sees here
    // S = Q·Kᵀ, one packed group of 16 keys (two vectors of 8 scores per row) per pass
    if constexpr (simd::kBf16Dot) pair_scores<R>(kb, q_rows, keys, D, s);
    else
    for (int64_t k0 = 0; k0 < keys; k0 += 16) {
      const uint16_t* kg = kb + k0 * D;  // the packed group of keys k0..k0+15
      __m256 acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        __m256 x0, x1;
        load16_interleaved(kg + d * kGroupKeys, x0, x1);
        for (int r = 0; r < R; ++r) {
          const __m256 qb = _mm256_broadcast_ss(qf + r * D + d);
          acc[r][0] = _mm256_fmadd_ps(qb, x0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(qb, x1, acc[r][1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        simd::store8(s + r * kBlockKeys + k0, acc[r][0]);
        simd::store8(s + r * kBlockKeys + k0 + 8, acc[r][1]);
      }
    }
    // the softmax step of each row that sees this block
    float corr[R];
    bool rescale = false;
    for (int r = 0; r < R; ++r) {
      const int64_t visible = std::min<int64_t>(kBlockKeys, last[r] - pos + 1);
      if (visible <= 0) {
        corr[r] = 1.f;
        std::fill(p + r * kBlockKeys, p + (r + 1) * kBlockKeys, 0.f);
        continue;
      }
      corr[r] = softmax_step(s + r * kBlockKeys, visible, kv.scale, kv.softcap, kv.ks ? kv.ks + pos : nullptr,
                             kv.vs ? kv.vs + pos : nullptr, st[r], l + r * 8, p + r * kBlockKeys);
      rescale |= corr[r] != 1.f;
    }
    if constexpr (simd::kBf16Dot)  // the probabilities as the bf16 they already are (exact)
      for (int r = 0; r < R; ++r)
        for (int64_t k = 0; k < kBlockKeys; k += 8) simd::store8(pbf + r * kBlockKeys + k, simd::load8(p + r * kBlockKeys + k));
    // O = O·corr + P·V, 32 features per pass at the pair levels (head_dim is a multiple of 32)
    if constexpr (simd::kBf16Dot) {
      for (int64_t c = 0; c < D; c += 32) {
        __m256 acc[R][4];
        for (int r = 0; r < R; ++r) {
          const __m256 cv = _mm256_set1_ps(corr[r]);
          for (int v = 0; v < 4; ++v) {
            acc[r][v] = simd::load8(o + r * D + c + 8 * v);
            if (rescale) acc[r][v] = _mm256_mul_ps(acc[r][v], cv);
          }
        }
        pair_values<R, 4>(vb, pbf, keys, D, c, acc);
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < 4; ++v) simd::store8(o + r * D + c + 8 * v, acc[r][v]);
      }
    } else
    for (int64_t c = 0; c < D; c += 16) {
      __m256 acc[R][2];
      for (int r = 0; r < R; ++r) {
        acc[r][0] = simd::load8(o + r * D + c);
        acc[r][1] = simd::load8(o + r * D + c + 8);
      }
      if (rescale) {
        for (int r = 0; r < R; ++r) {
          const __m256 cv = _mm256_set1_ps(corr[r]);
          acc[r][0] = _mm256_mul_ps(acc[r][0], cv);
          acc[r][1] = _mm256_mul_ps(acc[r][1], cv);
        }
      }
      for (int64_t k = 0; k < keys; ++k) {
        __m256 x0, x1;
        load16_interleaved(vb + k * D + c, x0, x1);
        for (int r = 0; r < R; ++r) {
          const __m256 pb = _mm256_broadcast_ss(p + r * kBlockKeys + k);
          acc[r][0] = _mm256_fmadd_ps(pb, x0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(pb, x1, acc[r][1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        simd::store8(o + r * D + c, acc[r][0]);
        simd::store8(o + r * D + c + 8, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 inv = _mm256_set1_ps(1.f / simd::hsum8(simd::load8(l + r * 8)));
    for (int64_t d = 0; d < D; d += 8) simd::store8(out_rows[r] + d, _mm256_mul_ps(simd::load8(o + r * D + d), inv));
  }
}

void attend_rows(int rows, const KvView& kv, const uint16_t* const* q_rows, uint16_t* const* out_rows,
                 const int64_t* last, Scratch& w) {
  switch (rows) {
    case 1: attend_tile<1>(kv, q_rows, out_rows, last, w); break;
    case 2: attend_tile<2>(kv, q_rows, out_rows, last, w); break;
    case 3: attend_tile<3>(kv, q_rows, out_rows, last, w); break;
    case 4: attend_tile<4>(kv, q_rows, out_rows, last, w); break;
    case 5: attend_tile<5>(kv, q_rows, out_rows, last, w); break;
    default: attend_tile<6>(kv, q_rows, out_rows, last, w); break;
  }
}
static_assert(kTileRows == 6, "attend_rows instantiates 1..6 rows");

}  // namespace

void paged_prefill_attention(const PrefillAttentionArgs& a) {
  const int64_t n = a.num_segments, D = a.head_dim, num_heads = a.num_heads, num_kv = a.num_kv_heads;
  const int64_t g = num_heads / num_kv, row_elems = num_kv * D;
  const int64_t* seg = a.segments;
  if (n == 0) return;
  auto shared_len = [&](int64_t i) -> int64_t { return a.shared_len ? a.shared_len[i] : 0; };
  auto leader = [&](int64_t i) -> int64_t { return a.shared_len && a.shared_len[i] ? a.leader[i] : i; };

  // phase 1: where each (segment, KV head) packs its K/V (its positions from shared_len on) and scales
  std::vector<int64_t> kv_offset(n * num_kv), scale_offset(n * num_kv, 0);
  int64_t kv_total = 0, scale_total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ctx = seg[i * 4 + 1] + seg[i * 4 + 2];
    const int64_t padded = round_up(ctx - shared_len(i), kBlockKeys);
    for (int64_t h = 0; h < num_kv; ++h) {
      kv_offset[i * num_kv + h] = kv_total;
      kv_total += 2 * padded * D;
      if (a.int8) {
        scale_offset[i * num_kv + h] = scale_total;
        scale_total += 2 * round_up(ctx, kBlockKeys);
      }
    }
  }
  std::unique_ptr<uint16_t[]> kv_buf(new uint16_t[std::max<int64_t>(kv_total, 1)]);
  std::unique_ptr<float[]> scale_buf(new float[std::max<int64_t>(scale_total, 1)]);
  const int64_t units1 = n * num_kv;
  // phase 2's units: (segment, KV head, tile of kTileRows rows), a segment's later (longer) tiles first
  std::vector<int64_t> unit_start(n + 1, 0), tiles(n);
  for (int64_t i = 0; i < n; ++i) {
    tiles[i] = (seg[i * 4 + 1] * g + kTileRows - 1) / kTileRows;
    unit_start[i + 1] = unit_start[i] + num_kv * tiles[i];
  }
  const int64_t units2 = unit_start[n];
#pragma omp parallel
  {
    std::vector<uint16_t> widened(2 * kGroupKeys * D), zeros(D, 0);  // int8 rows widened; a key past the context
    Scratch scratch(D);
    // phase 1
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units1; ++u) {
      const int64_t i = u / num_kv, h = u % num_kv;
      const int64_t ctx = seg[i * 4 + 1] + seg[i * 4 + 2], skip = shared_len(i);
      const int64_t padded = round_up(ctx - skip, kBlockKeys);
      const int64_t* s = a.slots + seg[i * 4 + 3];
      uint16_t* k_out = kv_buf.get() + kv_offset[u];
      uint16_t* v_out = k_out + padded * D;
      if (a.int8) {
        pack_kv(static_cast<const int8_t*>(a.k_pool), static_cast<const int8_t*>(a.v_pool), row_elems, h, s + skip,
                ctx - skip, padded, D, k_out, v_out, widened.data(), zeros.data());
        const int64_t width = round_up(ctx, kBlockKeys);
        float* ks = scale_buf.get() + scale_offset[u];
        float* vs = ks + width;
        for (int64_t key = 0; key < width; ++key) {
          ks[key] = key < ctx ? a.k_scale[s[key] * num_kv + h] : 0.f;
          vs[key] = key < ctx ? a.v_scale[s[key] * num_kv + h] : 0.f;
        }
      } else {
        pack_kv(static_cast<const uint16_t*>(a.k_pool), static_cast<const uint16_t*>(a.v_pool), row_elems, h, s + skip,
                ctx - skip, padded, D, k_out, v_out, widened.data(), zeros.data());
      }
    }
    // (the implicit barrier here: every K/V is packed before any tile reads its leader's)

    // phase 2
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units2; ++u) {
      const int64_t i = std::upper_bound(unit_start.begin(), unit_start.end(), u) - unit_start.begin() - 1;
      const int64_t local = u - unit_start[i];
      const int64_t h = local / tiles[i], t = tiles[i] - 1 - local % tiles[i];
      const int64_t q0 = seg[i * 4], m = seg[i * 4 + 1], s0 = seg[i * 4 + 2];
      const int64_t ctx = m + s0, width = round_up(ctx, kBlockKeys);
      const int64_t own_padded = round_up(ctx - shared_len(i), kBlockKeys);
      const int64_t lead = leader(i);
      const int64_t lead_padded = round_up(seg[lead * 4 + 1] + seg[lead * 4 + 2] - shared_len(lead), kBlockKeys);
      const uint16_t* own = kv_buf.get() + kv_offset[i * num_kv + h];
      const uint16_t* lk = kv_buf.get() + kv_offset[lead * num_kv + h];
      const float* ks = a.int8 ? scale_buf.get() + scale_offset[i * num_kv + h] : nullptr;
      const KvView view{lk, lk + lead_padded * D, own, own + own_padded * D, shared_len(i), ks,
                        ks ? ks + width : nullptr, D, a.scale, a.softcap};
      const uint16_t* q_rows[kTileRows];
      uint16_t* out_rows[kTileRows];
      int64_t last[kTileRows];
      const int64_t first = t * kTileRows, rows = std::min<int64_t>(kTileRows, m * g - first);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = (first + r) / g, head = h * g + (first + r) % g;
        const int64_t offset = ((q0 + pos) * num_heads + head) * D;
        q_rows[r] = a.q + offset;
        out_rows[r] = a.out + offset;
        last[r] = s0 + pos;
      }
      attend_rows(static_cast<int>(rows), view, q_rows, out_rows, last, scratch);
    }
  }
}

}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
