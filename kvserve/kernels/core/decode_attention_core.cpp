// Paged decode attention, torch-free (decode_attention.h states the contract and the arithmetic).
//
// Work: items (row b, split of kSplit positions, run of KV heads); each thread takes a
// contiguous run of items holding about its share of the positions. An item walks its
// positions in tiles of kTile (the rows of the tile after, or of the thread's next item,
// trickled into L2 meanwhile: blocks sit anywhere in the pool) and, per tile, for each of its
// KV heads runs one online-softmax step of
// that head's g query heads. An item takes all the KV heads of its slots (each slot's rows one
// contiguous run) unless that leaves fewer than two items per thread; which heads share an item
// never changes a head's arithmetic. Per KV head and tile:
//   scores  for each 8 positions, the g heads in pairs (2 heads × 4 positions) or alone
//           (1 × 8): each K row is loaded and widened to fp32 in registers once per pair of
//           heads, 16 features at a time, and multiplied with the heads' fp32 queries; the 8
//           partial-sum vectors reduce together (one hadd tree, the same association in every
//           lane), so a score's bits do not depend on which heads or positions share its step.
//   softmax per head: the tile's max, the rescale factor e^(old max - new max) of the
//           accumulators and of the lane-wise running Σ, e^(score - max) (simd::exp8).
//   values  each V row widened once per group of up to 4 heads, 8 fp32 accumulators per
//           (heads × features) block in registers, positions in order.
// bf16 rows widen in "lane order": the 16 bf16 of a 256-bit load give the even features (the
// low halves, shifted up) and the odd ones (the high halves, masked), so the queries are laid
// out in that order and the output is put back in feature order at the end. fp32 and int8
// rows keep feature order. At the bf16 pair-dot levels (Bf16PairRows) no row is widened: a
// score is one VDPBF16PS per 16 features against the query's pairs as stored, and the V pass
// pairs two positions per VDPBF16PS (their rows unpacked into feature pairs, P as bf16 pairs).
//
// An item's arithmetic depends on its row's q, its K/V rows and its range only: items of
// rows with one split finalise their output directly, the others leave (acc, max, Σ) for a
// merge of the splits in order. Which thread runs what never changes a bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include <omp.h>

#include "decode_attention.h"

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace decode_attention {
namespace {

constexpr int64_t kMaxG = kMaxQueriesPerKvHead;
constexpr int64_t kQStride = kMaxHeadDim;  // floats per head in the per-item buffers
constexpr int64_t kParallelMinWork = 2048;  // (KV head, position) pairs worth a second thread
static_assert(kSplit % kTile == 0 && kTile % 8 == 0, "tiles of whole 8-position steps, splits of whole tiles");

inline float exp1(float x) { return _mm256_cvtss_f32(simd::exp8(_mm256_set1_ps(x))); }

// ---- row formats: 16 features of a row as two fp32 vectors ----

struct Bf16Rows {
  using Elem = uint16_t;
  static constexpr int64_t kBytes = 2;
  static constexpr bool kPairDot = false;
  // lanes: the even features 2l, then the odd ones 2l + 1 (l = 0..7)
  static inline void load16(const uint16_t* p, __m256& a, __m256& b) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static constexpr int feature(int i) { return 2 * (i % 8) + i / 8; }  // lane-order index i -> feature
};

// bf16 rows read by bf16 pair dots (simd::kBf16Dot, bf16 queries): scores take the query's
// pairs as they are stored; the V pass pairs two positions feature by feature (unpacklo/hi of
// their rows), so its accumulators hold, per 16 features, unpacklo's features 0-3, 8-11, then
// unpackhi's 4-7, 12-15
struct Bf16PairRows {
  using Elem = uint16_t;
  static constexpr int64_t kBytes = 2;
  static constexpr bool kPairDot = true;
  static constexpr int feature(int i) { return i < 8 ? (i < 4 ? i : i + 4) : (i < 12 ? i - 4 : i); }
};

struct F32Rows {
  using Elem = float;
  static constexpr int64_t kBytes = 4;
  static constexpr bool kPairDot = false;
  static inline void load16(const float* p, __m256& a, __m256& b) {
    a = _mm256_loadu_ps(p);
    b = _mm256_loadu_ps(p + 8);
  }
  static constexpr int feature(int i) { return i; }
};

struct I8Rows {
  using Elem = int8_t;
  static constexpr int64_t kBytes = 1;
  static constexpr bool kPairDot = false;
  static inline void load16(const int8_t* p, __m256& a, __m256& b) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
    b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(x, x)));
  }
  static constexpr int feature(int i) { return i; }
};

// r[i] = Σ of the 8 lanes of v[i], each as ((0+1)+(2+3))+((4+5)+(6+7)) whatever i
inline __m256 reduce8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// q_j · k_p for G heads (qf rows kQStride apart, lane order) and P rows: lane jj·P + p
template <class R, int G, int P>
inline __m256 dots(const float* qf, const typename R::Elem* const* rows, int64_t off, int64_t H) {
  static_assert(G * P == 8, "one vector of 8 sums");
  __m256 acc[G * P];
#pragma GCC unroll 8
  for (int i = 0; i < G * P; ++i) acc[i] = _mm256_setzero_ps();
  if constexpr (R::kPairDot) {  // q as bf16 pairs (qf rows reinterpreted), one VDPBF16PS per 16 features
    for (int64_t c = 0; c < H; c += 16) {
      __m256i qv[G];
#pragma GCC unroll 2
      for (int j = 0; j < G; ++j) qv[j] = simd::load16_bf16(reinterpret_cast<const uint16_t*>(qf + j * kQStride) + c);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const __m256i kv = simd::load16_bf16(rows[p] + off + c);
#pragma GCC unroll 2
        for (int j = 0; j < G; ++j) acc[j * P + p] = simd::dot2_bf16(acc[j * P + p], qv[j], kv);
      }
    }
    return reduce8(acc);
  } else {
  for (int64_t c = 0; c < H; c += 16) {
    __m256 qa[G], qb[G];
#pragma GCC unroll 2
    for (int j = 0; j < G; ++j) {
      qa[j] = _mm256_loadu_ps(qf + j * kQStride + c);
      qb[j] = _mm256_loadu_ps(qf + j * kQStride + c + 8);
    }
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      __m256 ka, kb;
      R::load16(rows[p] + off + c, ka, kb);
#pragma GCC unroll 2
      for (int j = 0; j < G; ++j) {
        acc[j * P + p] = _mm256_fmadd_ps(qa[j], ka, acc[j * P + p]);
        acc[j * P + p] = _mm256_fmadd_ps(qb[j], kb, acc[j * P + p]);
      }
    }
  }
  return reduce8(acc);
  }
}

// The lines of the rows that come after the current tile, asked into L2 a few at a time: hook()
// is called once per 8 positions of each KV head's scores, so the requests trickle out over the
// whole tile. In one burst per tile (or per KV head: 256 lines for 8 heads of 64) they filled
// the miss buffers and evicted the rows being read (64 rows of 256 positions from memory: 3.3 ms
// a call against 2.2 for a kernel that trickled them).
struct Prefetcher {
  const char* rows[2 * kTile];  // K rows, then V rows
  int64_t count = 0, lines_per_row = 0, per_call = 0, next = 0;
  void hook() {
    const int64_t total = count * lines_per_row;
    for (int64_t e = std::min(total, next + per_call); next < e; ++next)
      _mm_prefetch(rows[next / lines_per_row] + (next % lines_per_row) * 64, _MM_HINT_T1);
  }
};

// sc[j·kTile + s] = (q_j·k_s)·mult[s] for the tile's n positions (rows[s] for s < n; rows past
// n repeat a live one), -inf past n
template <class R>
void tile_scores(const float* qf, int64_t g, const typename R::Elem* const* rows, int64_t off, int64_t n, int64_t H,
                 const float* mult, float* sc, Prefetcher& pf) {
  for (int64_t s0 = 0; s0 < kTile; s0 += 8) {
    pf.hook();
    if (s0 >= n) {
      for (int64_t j = 0; j < g; ++j) _mm256_storeu_ps(sc + j * kTile + s0, _mm256_set1_ps(-INFINITY));
      continue;
    }
    int64_t j = 0;
    for (; j + 2 <= g; j += 2)
      for (int64_t h = 0; h < 8; h += 4) {
        // lanes 0-3: head j's 4 positions, 4-7: head j + 1's
        const __m256 v = dots<R, 2, 4>(qf + j * kQStride, rows + s0 + h, off, H);
        const __m128 m4 = _mm_loadu_ps(mult + s0 + h);
        _mm_storeu_ps(sc + j * kTile + s0 + h, _mm_mul_ps(_mm256_castps256_ps128(v), m4));
        _mm_storeu_ps(sc + (j + 1) * kTile + s0 + h, _mm_mul_ps(_mm256_extractf128_ps(v, 1), m4));
      }
    if (j < g) _mm256_storeu_ps(sc + j * kTile + s0, _mm256_mul_ps(dots<R, 1, 8>(qf + j * kQStride, rows + s0, off, H),
                                                                   _mm256_loadu_ps(mult + s0)));
    if (s0 + 8 > n)  // a partial last step: its spare lanes out of the softmax
      for (int64_t jj = 0; jj < g; ++jj)
        for (int64_t s = n; s < s0 + 8; ++s) sc[jj * kTile + s] = -INFINITY;
  }
}

// Gemma 2's soft-capping of a tile's scores (sc as tile_scores leaves it): the n live positions
// of each head capped, the lanes past n left at -inf
inline void cap_scores(float* sc, int64_t g, int64_t n, float cap) {
  const __m256 c = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.f / cap), neg_inf = _mm256_set1_ps(-INFINITY);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j = 0; j < g; ++j)
    for (int64_t s = 0; s < n; s += 8) {
      __m256 v = simd::softcap8(_mm256_loadu_ps(sc + j * kTile + s), c, inv);
      if (s + 8 > n)
        v = _mm256_blendv_ps(neg_inf, v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - s)), iota)));
      _mm256_storeu_ps(sc + j * kTile + s, v);
    }
}

// acc[j][c0 .. c0 + 16C) = acc·alpha[j] + Σ_s p[j][s]·V[s] for heads j0 .. j0 + G, positions in order
// (pair rows: two positions a step, P as bf16 pairs from pbf, their V rows unpacked into pairs;
// a last odd position pairs with a live row whose P is 0)
template <class R, int G, int C>
void tile_values(const typename R::Elem* const* rows, int64_t off, int64_t n, const float* p, const uint16_t* pbf,
                 int64_t j0, const float* alpha, float* acc, int64_t c0) {
  __m256 a[G][2 * C];
#pragma GCC unroll 4
  for (int j = 0; j < G; ++j) {
    const __m256 al = _mm256_set1_ps(alpha[j0 + j]);
#pragma GCC unroll 8
    for (int d = 0; d < 2 * C; ++d) a[j][d] = _mm256_mul_ps(_mm256_loadu_ps(acc + (j0 + j) * kQStride + c0 + d * 8), al);
  }
  if constexpr (R::kPairDot) {
    for (int64_t s = 0; s < n; s += 2) {
      const uint16_t* r0 = rows[s] + off + c0;
      const uint16_t* r1 = rows[s + 1] + off + c0;  // rows past n repeat a live one (P 0)
      __m256i pp[G];
#pragma GCC unroll 4
      for (int j = 0; j < G; ++j) pp[j] = simd::bcast_pair(pbf + (j0 + j) * kTile + s);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m256i x0 = simd::load16_bf16(r0 + c * 16), x1 = simd::load16_bf16(r1 + c * 16);
        const __m256i lo = _mm256_unpacklo_epi16(x0, x1), hi = _mm256_unpackhi_epi16(x0, x1);
#pragma GCC unroll 4
        for (int j = 0; j < G; ++j) {
          a[j][2 * c] = simd::dot2_bf16(a[j][2 * c], lo, pp[j]);
          a[j][2 * c + 1] = simd::dot2_bf16(a[j][2 * c + 1], hi, pp[j]);
        }
      }
    }
  } else {
  for (int64_t s = 0; s < n; ++s) {
    const typename R::Elem* row = rows[s] + off + c0;
    __m256 pj[G];
#pragma GCC unroll 4
    for (int j = 0; j < G; ++j) pj[j] = _mm256_broadcast_ss(p + (j0 + j) * kTile + s);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      __m256 va, vb;
      R::load16(row + c * 16, va, vb);
#pragma GCC unroll 4
      for (int j = 0; j < G; ++j) {
        a[j][2 * c] = _mm256_fmadd_ps(pj[j], va, a[j][2 * c]);
        a[j][2 * c + 1] = _mm256_fmadd_ps(pj[j], vb, a[j][2 * c + 1]);
      }
    }
  }
  }
#pragma GCC unroll 4
  for (int j = 0; j < G; ++j)
#pragma GCC unroll 8
    for (int d = 0; d < 2 * C; ++d) _mm256_storeu_ps(acc + (j0 + j) * kQStride + c0 + d * 8, a[j][d]);
}

template <class R>
void values_all(const typename R::Elem* const* rows, int64_t off, int64_t n, const float* p, const uint16_t* pbf,
                int64_t g, int64_t H, const float* alpha, float* acc) {
  const int64_t chunks = H / 16;
  for (int64_t j0 = 0; j0 < g; j0 += 4) {
    const int64_t G = std::min<int64_t>(4, g - j0);
    // 2·G·C <= 8 accumulators; 16 where the pair path has the registers (its V rows need no widening)
    const int64_t most = R::kPairDot && simd::kVecRegs >= 32 ? (G <= 2 ? 4 : 2) : G == 1 ? 4 : G == 2 ? 2 : 1;
    const int64_t C = (most >= 4 && chunks % 4 == 0) ? 4 : (most >= 2 && chunks % 2 == 0) ? 2 : 1;
    for (int64_t c0 = 0; c0 < H; c0 += 16 * C) {
      switch (G * 8 + C) {
        case 8 + 1: tile_values<R, 1, 1>(rows, off, n, p, pbf, j0, alpha, acc, c0); break;
        case 8 + 2: tile_values<R, 1, 2>(rows, off, n, p, pbf, j0, alpha, acc, c0); break;
        case 8 + 4: tile_values<R, 1, 4>(rows, off, n, p, pbf, j0, alpha, acc, c0); break;
        case 16 + 1: tile_values<R, 2, 1>(rows, off, n, p, pbf, j0, alpha, acc, c0); break;
        case 16 + 2: tile_values<R, 2, 2>(rows, off, n, p, pbf, j0, alpha, acc, c0); break;
        case 16 + 4: if constexpr (R::kPairDot) tile_values<R, 2, 4>(rows, off, n, p, pbf, j0, alpha, acc, c0); break;
        case 24 + 1: tile_values<R, 3, 1>(rows, off, n, p, pbf, j0, alpha, acc, c0); break;
        case 24 + 2: if constexpr (R::kPairDot) tile_values<R, 3, 2>(rows, off, n, p, pbf, j0, alpha, acc, c0); break;
        case 32 + 2: if constexpr (R::kPairDot) tile_values<R, 4, 2>(rows, off, n, p, pbf, j0, alpha, acc, c0); break;
        default: tile_values<R, 4, 1>(rows, off, n, p, pbf, j0, alpha, acc, c0); break;
      }
    }
  }
}

// One split's state for the g heads of one KV head: acc in lane order, running max, Σ of
// e^(score - max) (lane-wise while running, then reduced).
struct SplitState {
  float* acc;   // [g][kQStride]
  float* m;     // [g]
  float* l;     // [g]
  float* lsum;  // [g][8], the running Σ per lane
};

// Rows of the tile [p0, p0 + n) of row b's positions: slot indices.
inline void tile_slots(const Args& a, int64_t b, int64_t p0, int64_t n, int64_t* slots) {
  const int32_t* table = a.block_tables + b * a.max_blocks;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t pos = p0 + s;
    slots[s] = static_cast<int64_t>(table[pos / a.block_size]) * a.block_size + pos % a.block_size;
  }
}

// One tile of one KV head: scores, the online softmax step, the V pass (st updated).
template <class R>
void tile_step(const Args& a, int64_t kvh, const typename R::Elem* const* krows, const typename R::Elem* const* vrows,
               const int64_t* slots, int64_t n, const float* qf, const SplitState& st, Prefetcher& pf) {
  const int64_t g = a.num_heads / a.num_kv_heads, H = a.head_dim;
  const bool int8 = a.pool == PoolType::kInt8;
  const int64_t off = kvh * H;
  alignas(32) float sc[kMaxG * kTile];
  alignas(32) float pr[kMaxG * kTile];
  alignas(32) uint16_t pbf[R::kPairDot ? kMaxG * kTile : 1];  // pair rows: P as the bf16 the V pass takes
  alignas(32) float mult[kTile];
  alignas(32) float vsc[kTile];
  alignas(32) float alpha[kMaxG];
  if (int8) {
    for (int64_t s = 0; s < kTile; ++s) {
      const int64_t slot = slots[s < n ? s : 0];
      mult[s] = a.k_scale[slot * a.num_kv_heads + kvh] * a.scale;
      vsc[s] = s < n ? a.v_scale[slot * a.num_kv_heads + kvh] : 0.f;
    }
  } else {
    for (int64_t s = 0; s < kTile; ++s) mult[s] = a.scale;
  }
  tile_scores<R>(qf, g, krows, off, n, H, mult, sc, pf);
  if (a.softcap > 0.f) cap_scores(sc, g, n, a.softcap);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j = 0; j < g; ++j) {
    const float* sj = sc + j * kTile;
    __m256 mx = _mm256_loadu_ps(sj);
    for (int64_t s = 8; s < kTile; s += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sj + s));
    const float m_old = st.m[j];
    const float m_new = std::max(m_old, simd::hmax8(mx));
    const float al = m_old == -INFINITY ? 0.f : exp1(m_old - m_new);
    st.m[j] = m_new;
    alpha[j] = al;
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(st.lsum + j * 8), _mm256_set1_ps(al));
    for (int64_t s = 0; s < kTile; s += 8) {
      float* pj = pr + j * kTile + s;
      if (s >= n) {
        _mm256_storeu_ps(pj, _mm256_setzero_ps());
        if constexpr (R::kPairDot) std::memset(pbf + j * kTile + s, 0, 8 * sizeof(uint16_t));
        continue;
      }
      __m256 e = simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + s), mv));
      if (s + 8 > n) e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - s)), iota)));
      sum = _mm256_add_ps(sum, e);
      if (R::kBytes == 2) e = simd::round_bf16(e);                    // bf16 pools: P in bf16, as dpbf16 takes it
      else if (int8) e = _mm256_mul_ps(e, _mm256_loadu_ps(vsc + s));  // int8: the V scale on the probability
      _mm256_storeu_ps(pj, e);
      if constexpr (R::kPairDot) simd::store8(pbf + j * kTile + s, e);  // already bf16: exact
    }
    _mm256_storeu_ps(st.lsum + j * 8, sum);
  }
  values_all<R>(vrows, off, n, pr, pbf, g, H, alpha, st.acc);
}

// Where the rows that follow the current tile are: the next tile of this item or, at its last
// tile, the first of the thread's next item (row b, positions [p0, p1), KV heads [kvh0, kvh1))
struct TileRef {
  int64_t b = -1, p0 = 0, n = 0, kvh0 = 0, kvh1 = 0;
};

// Online softmax of one item: row b, positions [p0, p1) (whole tiles from p0), KV heads
// [kvh0, kvh1) (st[h - kvh0], qf rows of g·kQStride per head). A tile's slot rows serve all
// the item's heads (one contiguous run per slot); each head's arithmetic is its own.
// While a tile computes, the rows of the one after it (`after`: this item's next tile, else the
// thread's next item's first) are asked into L2 a KV head's share at a time: blocks sit
// anywhere in the pool, so the hardware prefetcher restarts at each (Prefetcher says why the
// requests trickle out).
template <class R>
void run_item(const Args& a, int64_t b, int64_t p0, int64_t p1, int64_t kvh0, int64_t kvh1, const float* qf,
              const SplitState* st, const TileRef& next_item) {
  using Elem = typename R::Elem;
  const int64_t g = a.num_heads / a.num_kv_heads, H = a.head_dim;
  const int64_t slot_stride = a.num_kv_heads * H;
  const Elem* kp = static_cast<const Elem*>(a.k_pool);
  const Elem* vp = static_cast<const Elem*>(a.v_pool);
  int64_t slots[kTile], next_slots[kTile];
  const Elem* krows[kTile];
  const Elem* vrows[kTile];
  for (int64_t h = kvh0; h < kvh1; ++h) {
    const SplitState& s = st[h - kvh0];
    for (int64_t j = 0; j < g; ++j) {
      std::memset(s.acc + j * kQStride, 0, sizeof(float) * H);
      s.m[j] = -INFINITY;
      _mm256_storeu_ps(s.lsum + j * 8, _mm256_setzero_ps());
    }
  }
  tile_slots(a, b, p0, std::min(kTile, p1 - p0), next_slots);
  for (int64_t t0 = p0; t0 < p1; t0 += kTile) {
    const int64_t n = std::min(kTile, p1 - t0);
    std::memcpy(slots, next_slots, sizeof(int64_t) * n);
    for (int64_t s = 0; s < kTile; ++s) {
      const int64_t slot = slots[s < n ? s : 0];  // past n: a live row, its scores dropped
      krows[s] = kp + slot * slot_stride;
      vrows[s] = vp + slot * slot_stride;
    }
    TileRef after = next_item;
    if (t0 + kTile < p1) after = TileRef{b, t0 + kTile, std::min(kTile, p1 - t0 - kTile), kvh0, kvh1};
    int64_t pf_slots[kTile], pf_n = 0;
    if (after.b >= 0) {
      tile_slots(a, after.b, after.p0, after.n, pf_slots);
      pf_n = after.n;
      if (after.b == b && after.p0 == t0 + kTile) std::memcpy(next_slots, pf_slots, sizeof(int64_t) * pf_n);
    }
    const int64_t pf_off = after.kvh0 * H * R::kBytes, pf_len = (after.kvh1 - after.kvh0) * H * R::kBytes;
    Prefetcher pf;
    pf.count = 2 * pf_n;
    pf.lines_per_row = (pf_len + 63) / 64;
    for (int64_t s = 0; s < pf_n; ++s) {
      pf.rows[s] = reinterpret_cast<const char*>(kp + pf_slots[s] * slot_stride) + pf_off;
      pf.rows[pf_n + s] = reinterpret_cast<const char*>(vp + pf_slots[s] * slot_stride) + pf_off;
    }
    const int64_t hooks = (kvh1 - kvh0) * (kTile / 8);
    pf.per_call = (pf.count * pf.lines_per_row + hooks - 1) / hooks;
    for (int64_t h = kvh0; h < kvh1; ++h)
      tile_step<R>(a, h, krows, vrows, slots, n, qf + (h - kvh0) * g * kQStride, st[h - kvh0], pf);
  }
  for (int64_t h = kvh0; h < kvh1; ++h)
    for (int64_t j = 0; j < g; ++j) st[h - kvh0].l[j] = simd::hsum8(_mm256_loadu_ps(st[h - kvh0].lsum + j * 8));
}

// The splits of one (row, KV head) merged in order and normalised into the output: out[j] =
// (Σ_i w_i·acc_i) / (Σ_i w_i·l_i), w_i = e^(m_i - max), lse = max + log Σ. One split: w = 1,
// the same bits as its own normalisation.
template <class R>
void finish(const Args& a, int64_t b, int64_t kvh, const SplitState* parts, int64_t nparts) {
  const int64_t g = a.num_heads / a.num_kv_heads, H = a.head_dim;
  float w_local[64];
  std::vector<float> w_heap;
  float* w = w_local;
  if (nparts > 64) {
    w_heap.resize(nparts);
    w = w_heap.data();
  }
  alignas(32) float tmp[kMaxHeadDim];
  alignas(32) float nat[kMaxHeadDim];
  for (int64_t j = 0; j < g; ++j) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < nparts; ++i) mx = std::max(mx, parts[i].m[j]);
    float total = 0.f;
    for (int64_t i = 0; i < nparts; ++i) {
      w[i] = exp1(parts[i].m[j] - mx);
      total = i == 0 ? w[i] * parts[i].l[j] : total + w[i] * parts[i].l[j];
    }
    for (int64_t d = 0; d < H; d += 8) {
      __m256 v = _mm256_mul_ps(_mm256_set1_ps(w[0]), _mm256_loadu_ps(parts[0].acc + j * kQStride + d));
      for (int64_t i = 1; i < nparts; ++i)
        v = _mm256_fmadd_ps(_mm256_set1_ps(w[i]), _mm256_loadu_ps(parts[i].acc + j * kQStride + d), v);
      _mm256_store_ps(tmp + d, _mm256_mul_ps(v, _mm256_set1_ps(1.f / total)));
    }
    for (int64_t c = 0; c < H; c += 16)
      for (int i = 0; i < 16; ++i) nat[c + R::feature(i)] = tmp[c + i];
    const int64_t row = b * a.num_heads + kvh * g + j;
    if (a.out_bf16) {
      uint16_t* o = static_cast<uint16_t*>(a.out) + row * H;
      for (int64_t d = 0; d < H; d += 8) simd::store8(o + d, _mm256_load_ps(nat + d));
    } else {
      float* o = static_cast<float*>(a.out) + row * H;
      for (int64_t d = 0; d < H; d += 8) simd::store8(o + d, _mm256_load_ps(nat + d));
    }
    if (a.lse) a.lse[row] = mx + std::log(total);
  }
}

// q of row b, KV head kvh, its g heads in fp32 and R's lane order
template <class R>
void load_queries(const Args& a, int64_t b, int64_t kvh, float* qf) {
  const int64_t g = a.num_heads / a.num_kv_heads, H = a.head_dim;
  for (int64_t j = 0; j < g; ++j) {
    const int64_t base = (b * a.num_heads + kvh * g + j) * H;
    if constexpr (R::kPairDot) {  // bf16 as stored, in the float row's bytes
      std::memcpy(qf + j * kQStride, static_cast<const uint16_t*>(a.q) + base, sizeof(uint16_t) * H);
      continue;
    }
    for (int64_t c = 0; c < H; c += 16)
      for (int i = 0; i < 16; ++i) {
        const int64_t d = base + c + R::feature(i);
        qf[j * kQStride + c + i] =
            a.q_bf16 ? simd::bf16_to_f32(static_cast<const uint16_t*>(a.q)[d]) : static_cast<const float*>(a.q)[d];
      }
  }
}

template <class R>
void run(const Args& a) {
  const int64_t g = a.num_heads / a.num_kv_heads, H = a.head_dim, nkv = a.num_kv_heads;
  // per row: its splits, and where its parts go when it has several
  std::vector<int64_t> nsplits(a.B), part_base(a.B, -1);
  int64_t row_splits = 0, nparts = 0, positions = 0;
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t start = a.start_positions ? a.start_positions[b] : 0;
    const int64_t S = a.context_lens[b] - start;
    if (S <= 0) {  // an empty range: no weight anywhere
      nsplits[b] = 0;
      for (int64_t h = 0; h < a.num_heads; ++h) {
        const int64_t row = b * a.num_heads + h;
        if (a.out_bf16) std::memset(static_cast<uint16_t*>(a.out) + row * H, 0, sizeof(uint16_t) * H);
        else std::memset(static_cast<float*>(a.out) + row * H, 0, sizeof(float) * H);
        if (a.lse) a.lse[row] = -INFINITY;
      }
      continue;
    }
    nsplits[b] = (S + kSplit - 1) / kSplit;
    row_splits += nsplits[b];
    positions += S;
    if (nsplits[b] > 1) {
      part_base[b] = nparts;
      nparts += nsplits[b] * nkv;  // part (b, kvh, split) at part_base + kvh·nsplits + split
    }
  }
  // Items (row, split, run of KV heads): all the heads of a slot together (its rows one
  // contiguous run) unless that leaves too few items for the threads. Which heads share an
  // item changes no head's arithmetic.
  const int64_t threads = omp_get_max_threads();
  int64_t groups = 1;
  while (groups < nkv && row_splits * groups < 2 * threads) ++groups;
  const int64_t per_item = (nkv + groups - 1) / groups;
  groups = (nkv + per_item - 1) / per_item;
  struct Item {
    int64_t b, split, kvh0, kvh1;
  };
  std::vector<Item> items;
  items.reserve(row_splits * groups);
  std::vector<std::pair<int64_t, int64_t>> merges;  // (b, kvh) of rows with several splits
  for (int64_t b = 0; b < a.B; ++b) {
    for (int64_t i = 0; i < nsplits[b]; ++i)
      for (int64_t h = 0; h < nkv; h += per_item) items.push_back({b, i, h, std::min(nkv, h + per_item)});
    if (nsplits[b] > 1)
      for (int64_t h = 0; h < nkv; ++h) merges.emplace_back(b, h);
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t n_merges = static_cast<int64_t>(merges.size());
  const int64_t part_floats = g * (kQStride + 2 + 8);
  std::vector<float> parts(static_cast<size_t>(nparts * part_floats));
  auto part_state = [&](int64_t part) {
    float* base = parts.data() + part * part_floats;
    return SplitState{base, base + g * kQStride, base + g * kQStride + g, base + g * kQStride + 2 * g};
  };

  // Each thread takes a contiguous run of items holding about its share of the positions, so
  // it knows the item after the one it computes and can ask for that one's first rows early.
  std::vector<int64_t> item_pos(n_items + 1, 0);  // positions before each item
  for (int64_t it = 0; it < n_items; ++it) {
    const Item& item = items[it];
    const int64_t start = a.start_positions ? a.start_positions[item.b] : 0;
    const int64_t p0 = start + item.split * kSplit;
    item_pos[it + 1] = item_pos[it] + (std::min<int64_t>(a.context_lens[item.b], p0 + kSplit) - p0) * (item.kvh1 - item.kvh0);
  }
  auto item_range = [&](int64_t t, int64_t T) {  // the first item of thread t's run
    const int64_t target = item_pos[n_items] * t / T;
    return static_cast<int64_t>(std::lower_bound(item_pos.begin(), item_pos.end(), target) - item_pos.begin());
  };
  auto item_span = [&](const Item& item, int64_t& p0, int64_t& p1) {
    const int64_t start = a.start_positions ? a.start_positions[item.b] : 0;
    p0 = start + item.split * kSplit;
    p1 = std::min<int64_t>(a.context_lens[item.b], p0 + kSplit);
  };

  // below kParallelMinWork (KV head, position) pairs a second thread costs more than it
  // takes (measured at avx2, one row, 3 KV heads: 2 threads slower up to ~600 positions)
#pragma omp parallel if (n_items > 1 && positions * nkv >= kParallelMinWork)
  {
    std::vector<float> qf(static_cast<size_t>(per_item * g * kQStride));
    std::vector<float> local(static_cast<size_t>(per_item * part_floats));
    std::vector<SplitState> st(per_item);
    const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = item_range(t, T), last = t + 1 == T ? n_items : item_range(t + 1, T);
    for (int64_t it = first; it < last; ++it) {
      const Item& item = items[it];
      int64_t p0, p1;
      item_span(item, p0, p1);
      TileRef next;
      if (it + 1 < last) {
        const Item& ni = items[it + 1];
        int64_t q0, q1;
        item_span(ni, q0, q1);
        next = TileRef{ni.b, q0, std::min(kTile, q1 - q0), ni.kvh0, ni.kvh1};
      }
      const bool direct = nsplits[item.b] == 1;
      for (int64_t h = item.kvh0; h < item.kvh1; ++h) {
        load_queries<R>(a, item.b, h, qf.data() + (h - item.kvh0) * g * kQStride);
        if (direct) {
          float* base = local.data() + (h - item.kvh0) * part_floats;
          st[h - item.kvh0] = SplitState{base, base + g * kQStride, base + g * kQStride + g, base + g * kQStride + 2 * g};
        } else {
          st[h - item.kvh0] = part_state(part_base[item.b] + h * nsplits[item.b] + item.split);
        }
      }
      run_item<R>(a, item.b, p0, p1, item.kvh0, item.kvh1, qf.data(), st.data(), next);
      if (direct)
        for (int64_t h = item.kvh0; h < item.kvh1; ++h) finish<R>(a, item.b, h, &st[h - item.kvh0], 1);
    }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
    for (int64_t mi = 0; mi < n_merges; ++mi) {
      const int64_t b = merges[mi].first, h = merges[mi].second;
      std::vector<SplitState> states;
      states.reserve(nsplits[b]);
      for (int64_t i = 0; i < nsplits[b]; ++i) states.push_back(part_state(part_base[b] + h * nsplits[b] + i));
      finish<R>(a, b, h, states.data(), nsplits[b]);
    }
  }
}

}  // namespace

void paged_decode_attention(const Args& a) {
  switch (a.pool) {
    case PoolType::kBf16:
      if (simd::kBf16Dot && a.q_bf16) run<Bf16PairRows>(a);
      else run<Bf16Rows>(a);
      break;
    case PoolType::kFp32: run<F32Rows>(a); break;
    case PoolType::kInt8: run<I8Rows>(a); break;
  }
}

}  // namespace decode_attention
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
