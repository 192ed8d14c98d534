// Paged decode attention: one new query per request attending to its S0 + 1 cached
// positions, read in place from the block pool through the block table (no gather copy),
// g query heads of a KV head sharing each K/V row read. bf16 pools take AMX tiles where
// the CPU has them (amx_available: the `amx` level, tiles granted) and AVX512-BF16 dot products elsewhere; fp32 pools
// take fp32 FMAs. int8 pools (with a scale per position and KV head) are widened in
// registers on the AVX512 path, never AMX.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/bit_cast.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "../kernels.h"
#include "vec_math.h"

KVSERVE_KERNEL_FAMILY("decode_attention");

// Tests switch AMX attention off to check both paths of decode and prefill attention on
// one machine.

namespace {

// Softmax of n scores in place (fp32); returns their log-sum-exp, max + log Σ e^(s - max).
inline float softmax_inplace(float* sc, int64_t n) {
  const int64_t nv = n / 16 * 16;
  __m512 mxv = _mm512_set1_ps(-INFINITY);
  for (int64_t s = 0; s < nv; s += 16) mxv = _mm512_max_ps(mxv, _mm512_loadu_ps(sc + s));
  float mx = _mm512_reduce_max_ps(mxv);
  for (int64_t s = nv; s < n; ++s) mx = std::max(mx, sc[s]);
  const __m512 mxb = _mm512_set1_ps(mx);
  __m512 sumv = _mm512_setzero_ps();
  for (int64_t s = 0; s < nv; s += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + s), mxb));
    _mm512_storeu_ps(sc + s, e);
    sumv = _mm512_add_ps(sumv, e);
  }
  float sum = _mm512_reduce_add_ps(sumv);
  for (int64_t s = nv; s < n; ++s) { sc[s] = std::exp(sc[s] - mx); sum += sc[s]; }
  const float inv = 1.f / sum;
  const __m512 invb = _mm512_set1_ps(inv);
  for (int64_t s = 0; s < nv; s += 16) _mm512_storeu_ps(sc + s, _mm512_mul_ps(_mm512_loadu_ps(sc + s), invb));
  for (int64_t s = nv; s < n; ++s) sc[s] *= inv;
  return mx + std::log(sum);
}

// Horizontal sums of 16 vectors at once: returns r with r[k] = sum of all lanes of the
// vector for item k, in 15 shuffle-adds instead of 16 full reductions. The shuffle tree
// leaves item (L + 4e) in lane (4L + e), so callers store item k at index slot16(k).
inline int slot16(int k) { return (k % 4) * 4 + k / 4; }

inline __m512 transpose_sum16(__m512* v) {
  for (int i = 0; i < 8; ++i) {  // halves of 512 bits: 128-bit lanes {0,1} + {2,3}
    __m512 a = v[2 * i], b = v[2 * i + 1];
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes {0,2} + {1,3}
    __m512 a = v[2 * i], b = v[2 * i + 1];
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // within 128-bit lanes: elements {0,1} + {2,3}
    __m512 a = v[2 * i], b = v[2 * i + 1];
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  __m512 a = v[0], b = v[1];  // elements {0,2} + {1,3}
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

constexpr int64_t kMaxG = kDecodeAttentionMaxQueriesPerKvHead;
// 16-float vectors of the longest head (accumulator rows) and its 32-feature chunks: the
// score kernels below are instantiated for 1..kMaxChunks chunks, accumulate_values for the
// chunk/group pairs its grouping makes of them.
constexpr int kHeadVecs = kDecodeAttentionMaxHeadDim / 16;
constexpr int kMaxChunks = kDecodeAttentionMaxHeadDim / 32;
static_assert(kMaxChunks == 4, "vec_scores, amx_scores (B tiles 2..5) and accumulate_values cover 1..4 chunks");

// Dot products of one query head (pre-loaded) with one K row, as 16 fp32 partial sums
// (fp32 pools; bf16 takes vec_scores or amx_scores).
struct QueryF32 {
  __m512 v[kHeadVecs];  // head_dim / 16 chunks
  int n;
  void load(const float* q, int64_t head_dim) {
    n = static_cast<int>(head_dim / 16);
    for (int c = 0; c < n; ++c) v[c] = _mm512_loadu_ps(q + c * 16);
  }
  __m512 dot(const float* k) const {
    __m512 acc = _mm512_mul_ps(v[0], _mm512_loadu_ps(k));
    for (int c = 1; c < n; ++c) acc = _mm512_fmadd_ps(v[c], _mm512_loadu_ps(k + c * 16), acc);
    return acc;
  }
};

// acc[j] += Σ_s p_j[s] · V[s] over the S positions, for the g query heads of one KV head.
// How many of the g heads the V pass accumulates at once (chunks of 32 features per head):
// few enough for their accumulators to fit the 32 vector registers, of a size that divides g
// where one does, since a group's unused heads still cost their dot products (VDPBF16PS issues
// only every other cycle here, half the MAC rate of fp32 FMAs). The bf16 and int8 V passes
// share it.
inline int64_t value_head_group(int64_t g, int64_t chunks) {
  const int64_t most = chunks == 1 ? 8 : chunks == 2 ? 4 : 2;
  int64_t group = std::min(most, g);
  for (int64_t size = group; size >= 2; --size)
    if (g % size == 0) return size;
  return group;
}

inline void accumulate_values(const float* const* v_rows, int64_t off, const float* scores, int64_t S, int64_t g,
                              int64_t hv, __m512 (*acc)[kHeadVecs]) {
  for (int64_t s = 0; s < S; ++s) {
    const float* vrow = v_rows[s] + off;
    for (int64_t d = 0; d < hv; ++d) {
      const __m512 v = _mm512_loadu_ps(vrow + d * 16);
      for (int64_t j = 0; j < g; ++j) acc[j][d] = _mm512_fmadd_ps(_mm512_set1_ps(scores[j * S + s]), v, acc[j][d]);
    }
  }
}

// acc[0..1] (features 0-15, 16-31 of a 32-feature chunk) += the chunk's sums from the
// unpacklo/unpackhi pairing both V passes use: lo lane (4k + i) holds feature 8k + i, hi
// lane (4k + i) feature 8k + 4 + i (k = 128-bit lane).
inline void add_deinterleaved(__m512* acc, __m512 lo, __m512 hi) {
  const __m512i to_lo = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i to_hi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  acc[0] = _mm512_add_ps(acc[0], _mm512_permutex2var_ps(lo, to_lo, hi));
  acc[1] = _mm512_add_ps(acc[1], _mm512_permutex2var_ps(lo, to_hi, hi));
}

// The pair loop for up to G query heads and C chunks of 32 features, with G and C known at
// compile time so the 2·G·C accumulators stay in registers (with a runtime head count
// they lived on the stack, and this loop ran at ~70 cycles per pair of positions).
template <int G, int C>
void accumulate_pairs(const at::BFloat16* const* v_rows, int64_t off, const uint16_t* pbf, int64_t S_pad,
                      int64_t pairs_end, int64_t gcount, __m512 (*acc)[kHeadVecs]) {
  __m512 lo[G][C], hi[G][C];
#pragma GCC unroll 8
  for (int j = 0; j < G; ++j)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) lo[j][c] = hi[j][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < pairs_end; s += 2) {
    const at::BFloat16* v0 = v_rows[s] + off;
    const at::BFloat16* v1 = v_rows[s + 1] + off;
    __m512bh pair[G];
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
      // (p[s], p[s+1]) in every 32-bit lane, p[s] in the low half like V[s]
      int32_t both = 0;
      if (j < gcount) std::memcpy(&both, pbf + j * S_pad + s, sizeof(both));
      pair[j] = (__m512bh)_mm512_set1_epi32(both);
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + c * 32);
      const __m512i b = _mm512_loadu_si512(v1 + c * 32);
      // within each 128-bit lane: (a0 b0 a1 b1 a2 b2 a3 b3) and (a4 b4 … a7 b7)
      const __m512bh il = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh ih = (__m512bh)_mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 8
      for (int j = 0; j < G; ++j) {
        lo[j][c] = _mm512_dpbf16_ps(lo[j][c], il, pair[j]);
        hi[j][c] = _mm512_dpbf16_ps(hi[j][c], ih, pair[j]);
      }
    }
  }
  for (int j = 0; j < G && j < gcount; ++j)
    for (int c = 0; c < C; ++c) add_deinterleaved(&acc[j][2 * c], lo[j][c], hi[j][c]);
}

// bf16: two positions per step with dpbf16 (P in bf16, as FlashAttention feeds its PV
// product): the V rows of positions s and s+1 are interleaved so each fp32 lane d
// accumulates p[s]·V[s][d] + p[s+1]·V[s+1][d] in one instruction. `pbf` holds the g heads'
// bf16 probabilities in rows of S_pad (from exp_to_bf16), so a pair (p[s], p[s+1]) is one
// 32-bit broadcast.
inline void accumulate_values(const at::BFloat16* const* v_rows, int64_t off, const uint16_t* pbf, int64_t S_pad,
                              int64_t S, int64_t g, int64_t hv, __m512 (*acc)[kHeadVecs]) {
  const int64_t chunks = hv / 2;  // 32 bf16 per chunk
  const int64_t pairs_end = S / 2 * 2;
  const int64_t group = value_head_group(g, chunks);
  for (int64_t j0 = 0; j0 < g; j0 += group) {
    const int64_t n = std::min(group, g - j0);
    const uint16_t* p = pbf + j0 * S_pad;
    __m512 (*a)[kHeadVecs] = acc + j0;
    switch (chunks * 16 + group) {
      case 16 + 8: accumulate_pairs<8, 1>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 16 + 7: accumulate_pairs<7, 1>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 16 + 6: accumulate_pairs<6, 1>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 16 + 5: accumulate_pairs<5, 1>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 16 + 4: accumulate_pairs<4, 1>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 16 + 3: accumulate_pairs<3, 1>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 16 + 2: accumulate_pairs<2, 1>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 16 + 1: accumulate_pairs<1, 1>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 32 + 1: accumulate_pairs<1, 2>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 48 + 1: accumulate_pairs<1, 3>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 64 + 1: accumulate_pairs<1, 4>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 32 + 4: accumulate_pairs<4, 2>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 32 + 3: accumulate_pairs<3, 2>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 32 + 2: accumulate_pairs<2, 2>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 48 + 2: accumulate_pairs<2, 3>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      case 64 + 2: accumulate_pairs<2, 4>(v_rows, off, p, S_pad, pairs_end, n, a); break;
      default: TORCH_CHECK(false, "accumulate_values: no kernel for ", chunks, " chunks in groups of ", group);
    }
  }
  if (pairs_end < S) {  // an odd last position, its bf16 probability times V in fp32
    const at::BFloat16* vrow = v_rows[pairs_end] + off;
    for (int64_t d = 0; d < hv; ++d) {
      const __m512 v = load16(vrow + d * 16);
      for (int64_t j = 0; j < g; ++j) {
        const float pj = static_cast<float>(c10::bit_cast<at::BFloat16>(pbf[j * S_pad + pairs_end]));
        acc[j][d] = _mm512_fmadd_ps(_mm512_set1_ps(pj), v, acc[j][d]);
      }
    }
  }
}

// QKᵀ without AMX (bf16), for each query head 16 positions at a time: C chunks of 32
// features known at compile time, so the 16 partial-sum vectors stay in registers for
// transpose_sum16 (with a runtime chunk count they went through the stack, and this loop
// took ~45% of the kernel's samples on a Zen 4). Same contract as amx_scores: sc[j·S + s]
// = scale·q_j·k_s, row_max[j] for the softmax, `hook` after each block of the first head.
template <int C, typename Hook>
void vec_scores(const at::BFloat16* const* k_rows, int64_t off, int64_t S, int64_t g, const at::BFloat16* q,
                int64_t head_dim, float scale, float* sc, __m512* row_max, Hook&& hook) {
  const int64_t s_vec = S / 16 * 16;
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < g; ++j) {
    __m512bh qv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + j * head_dim + c * 32);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    float* out = sc + j * S;
    for (int64_t s0 = 0; s0 < s_vec; s0 += 16) {
      if (j == 0) hook();
      __m512 dots[16];
#pragma GCC unroll 16
      for (int k = 0; k < 16; ++k) {
        const at::BFloat16* row = k_rows[s0 + k] + off;
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(row));
#pragma GCC unroll 4
        for (int c = 1; c < C; ++c) acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(row + c * 32));
        dots[slot16(k)] = acc;
      }
      const __m512 v = _mm512_mul_ps(transpose_sum16(dots), scale_v);
      _mm512_storeu_ps(out + s0, v);
      mx = _mm512_max_ps(mx, v);
    }
    if (s_vec < S && j == 0) hook();
    for (int64_t s = s_vec; s < S; ++s) {
      const at::BFloat16* row = k_rows[s] + off;
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c) acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(row + c * 32));
      out[s] = _mm512_reduce_add_ps(acc) * scale;
      mx = _mm512_max_ps(mx, _mm512_set1_ps(out[s]));
    }
    row_max[j] = mx;
  }
}

// ---- QKᵀ on AMX tiles (bf16, block_size a multiple of 16) ----
//
// One block of 16 positions is an A tile as it lies in the pool (16 rows of one KV head's
// 32-feature chunk, 2·slot_stride bytes apart); the g query heads of that KV head, packed
// once per request as B tiles (VNNI pairs, g of 16 columns used), stay in tile registers.
// C[position][head] comes out with no horizontal sums: the AVX512 path spends ~45 shuffles
// and adds per 16 positions per head reducing dot products across lanes, and re-reads
// each K row once per head. Tiles: 0 = C, 1 = A, 2..5 = B (head_dim up to 128).
// B tiles for the g query heads of one KV head: qb[c][kp][n][i] = q[n][32c + 2kp + i].
inline void pack_query_tiles(const at::BFloat16* q, int64_t g, int64_t head_dim, uint16_t* qb) {
  const int64_t chunks = head_dim / 32;
  std::memset(qb, 0, chunks * 1024);
  const auto* src = reinterpret_cast<const uint16_t*>(q);
  for (int64_t n = 0; n < g; ++n)
    for (int64_t d = 0; d < head_dim; ++d) qb[(d / 32) * 512 + ((d % 32) / 2) * 32 + n * 2 + (d % 2)] = src[n * head_dim + d];
}

template <int Chunks>
inline void load_query_tiles(const uint16_t* qb) {
  _tile_loadd(2, qb, 64);
  if constexpr (Chunks > 1) _tile_loadd(3, qb + 512, 64);
  if constexpr (Chunks > 2) _tile_loadd(4, qb + 1024, 64);
  if constexpr (Chunks > 3) _tile_loadd(5, qb + 1536, 64);
}

// scores of 16 positions (rows of k, 2·row_elems bytes apart) against the loaded heads
template <int Chunks>
inline void block_scores(const at::BFloat16* k, int64_t row_bytes, float* c_out) {
  _tile_zero(0);
  _tile_loadd(1, k, row_bytes);
  _tile_dpbf16ps(0, 1, 2);
  if constexpr (Chunks > 1) {
    _tile_loadd(1, k + 32, row_bytes);
    _tile_dpbf16ps(0, 1, 3);
  }
  if constexpr (Chunks > 2) {
    _tile_loadd(1, k + 64, row_bytes);
    _tile_dpbf16ps(0, 1, 4);
  }
  if constexpr (Chunks > 3) {
    _tile_loadd(1, k + 96, row_bytes);
    _tile_dpbf16ps(0, 1, 5);
  }
  _tile_stored(0, c_out, 64);
}

// sc[j * S + s] = scale · q_j · k_s for the S positions of one request and one KV head,
// and row_max[j] (a vector whose max is head j's largest score) for the softmax. `hook`
// runs after each block's tile product: the caller prefetches a share of the next
// request's rows there, so those misses overlap the work instead of stalling in one burst.
template <int Chunks, typename Hook>
void amx_scores(const at::BFloat16* const* k_rows, int64_t off, int64_t S, int64_t g, int64_t row_bytes,
                const uint16_t* qb, float scale, float* sc, __m512* row_max, Hook&& hook) {
  for (int64_t j = 0; j < g; ++j) row_max[j] = _mm512_set1_ps(-INFINITY);
  load_query_tiles<Chunks>(qb);
  alignas(64) float c[16 * 16];
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t s0 = 0; s0 < S; s0 += 16) {
    block_scores<Chunks>(k_rows[s0] + off, row_bytes, c);
    hook();
    const int64_t live = std::min<int64_t>(16, S - s0);  // a last block's unwritten slots are never read back
    const __mmask16 mask = live == 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
    for (int64_t j = 0; j < g; ++j) {
      const __m512 v = _mm512_mul_ps(_mm512_i32gather_ps(column, c + j, 4), scale_v);
      _mm512_mask_storeu_ps(sc + j * S + s0, mask, v);
      row_max[j] = _mm512_mask_max_ps(row_max[j], mask, row_max[j], v);
    }
  }
}

// ---- PV on AMX tiles ----
//
// out[j] += Σ_s p[j][s]·V[s] for the g heads of one KV head: A = the probabilities (bf16,
// one row per head, 32 positions per tile), B = 32 positions × 16 features of V in VNNI
// pairs, built per tile from two rows at a time with the same unpack the AVX512 pass uses
// (so B's columns are features in that interleaved order, put back at the end). AMX does
// the multiply-adds at ~30x the rate of VDPBF16PS; building B is most of the cost.
// Tiles: 0 = A, 1 = B, 2..5 = C (lo/hi columns of up to two 32-feature chunks).
template <int Chunks>
void amx_values_pass(const at::BFloat16* const* v_rows, int64_t off, int64_t c_first, const uint16_t* pbf,
                     int64_t ld_p, int64_t S, int64_t g, __m512 (*acc)[kHeadVecs]) {
  off += c_first * 32;
  _tile_zero(2);
  _tile_zero(3);
  if constexpr (Chunks > 1) {
    _tile_zero(4);
    _tile_zero(5);
  }
  alignas(64) uint16_t bt[2 * Chunks][16 * 32];
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t s0 = 0; s0 < S; s0 += 32) {
    // positions past S are zero in V (the slots may hold anything, even NaN) and in p
    for (int kp = 0; kp < 16; ++kp) {
      const int64_t s = s0 + 2 * kp;
#pragma GCC unroll 2
      for (int c = 0; c < Chunks; ++c) {
        const __m512i a = s < S ? _mm512_loadu_si512(v_rows[s] + off + c * 32) : zero;
        const __m512i b = s + 1 < S ? _mm512_loadu_si512(v_rows[s + 1] + off + c * 32) : zero;
        _mm512_store_si512(bt[2 * c] + kp * 32, _mm512_unpacklo_epi16(a, b));
        _mm512_store_si512(bt[2 * c + 1] + kp * 32, _mm512_unpackhi_epi16(a, b));
      }
    }
    _tile_loadd(0, pbf + s0, ld_p * 2);
    _tile_loadd(1, bt[0], 64);
    _tile_dpbf16ps(2, 0, 1);
    _tile_loadd(1, bt[1], 64);
    _tile_dpbf16ps(3, 0, 1);
    if constexpr (Chunks > 1) {
      _tile_loadd(1, bt[2], 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(1, bt[3], 64);
      _tile_dpbf16ps(5, 0, 1);
    }
  }
  alignas(64) float c_out[2 * Chunks][16 * 16];
  _tile_stored(2, c_out[0], 64);
  _tile_stored(3, c_out[1], 64);
  if constexpr (Chunks > 1) {
    _tile_stored(4, c_out[2], 64);
    _tile_stored(5, c_out[3], 64);
  }
  // B's columns were features in the unpack order: put them back as the AVX512 pass does
  for (int64_t j = 0; j < g; ++j)
    for (int c = 0; c < Chunks; ++c)
      add_deinterleaved(&acc[j][2 * (c_first + c)], _mm512_load_ps(c_out[2 * c] + j * 16),
                        _mm512_load_ps(c_out[2 * c + 1] + j * 16));
}

// exp(score - max) of the g heads straight to bf16 rows of `ld` (zero past S; 16 rows
// allocated for the A tile), with 1/Σ per head for the output: one pass instead of the
// max / exp / normalise / round passes (the max came from amx_scores). Σ is of the fp32
// values, as FlashAttention sums P before rounding it for the PV product.
inline uint16_t* exp_to_bf16(const float* scores, int64_t S, int64_t g, const __m512* row_max, int64_t ld,
                             float* inv_sum, float* lse = nullptr) {
  thread_local std::vector<uint16_t> pbf;
  pbf.resize(16 * ld);
  for (int64_t j = 0; j < g; ++j) {
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(row_max[j]));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < ld; s0 += 16) {
      const int64_t live_n = std::max<int64_t>(0, std::min<int64_t>(16, S - s0));
      const __mmask16 live = live_n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << live_n) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + j * S + s0), mx)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pbf.data() + j * ld + s0), (__m256i)_mm512_cvtneps_pbh(e));
    }
    const float total = _mm512_reduce_add_ps(sum);
    inv_sum[j] = 1.f / total;
    if (lse) lse[j] = _mm512_reduce_max_ps(mx) + std::log(total);
  }
  return pbf.data();
}

// Request b attends to its positions [start_positions[b], context_lens[b]) (start 0 where
// start_positions is null); with `lse`, each head's log-sum-exp of its scores goes to
// lse[b·num_heads + head] (-inf and a zero output for an empty range).
template <typename T, typename OutT = T>
void decode_attention_impl(const T* q, const T* k_pool, const T* v_pool, const int32_t* block_tables,
                           const int32_t* context_lens, OutT* out, int64_t B, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, bool use_amx,
                           const int32_t* start_positions = nullptr, float* lse = nullptr) {
  const int64_t g = num_heads / num_kv_heads;
  TORCH_CHECK(g <= kMaxG, "paged_decode_attention: at most ", kMaxG, " query heads per KV head, got ", g);
  TORCH_CHECK((std::is_same_v<T, float>) || head_dim % kDecodeAttentionHeadDimMultipleBf16 == 0,
              "bf16 decode attention: head_dim % ", kDecodeAttentionHeadDimMultipleBf16, " == 0");
  const int64_t slot_stride = num_kv_heads * head_dim;  // elements per pool slot
  const int64_t hv = head_dim / 16;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const T*> k_rows, v_rows, next_k_rows, next_v_rows;
    __m512 dots[16];
    alignas(64) uint16_t qb[kMaxChunks * 512];  // the query heads' B tiles (AMX path)
    if (use_amx) configure_full_tiles(6);  // 0 = C, 1 = A, 2..5 = B
    // slot addresses of a request's positions, walking its block table (no division per position)
    auto slot_rows = [&](int64_t req, std::vector<const T*>& ks, std::vector<const T*>& vs) {
      const int64_t first = start_positions ? start_positions[req] : 0;
      const int64_t S = context_lens[req] - first;
      const int32_t* table = block_tables + req * max_blocks;
      ks.resize(S);
      vs.resize(S);
      for (int64_t s = 0, blk = first / block_size, o0 = first % block_size; s < S; ++blk, o0 = 0) {
        const int64_t base = static_cast<int64_t>(table[blk]) * block_size * slot_stride;
        for (int64_t o = o0; o < block_size && s < S; ++o, ++s) {
          ks[s] = k_pool + base + o * slot_stride;
          vs[s] = v_pool + base + o * slot_stride;
        }
      }
    };
    if (begin < end) slot_rows(begin, next_k_rows, next_v_rows);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t S = context_lens[b] - (start_positions ? start_positions[b] : 0);
      std::swap(k_rows, next_k_rows);
      std::swap(v_rows, next_v_rows);
      // the next request's rows are fetched while this one computes (more misses in flight)
      if (b + 1 < end) slot_rows(b + 1, next_k_rows, next_v_rows);
      else next_k_rows.clear(), next_v_rows.clear();
      const int64_t S_next = static_cast<int64_t>(next_k_rows.size());
      if (S == 0) {  // an empty range: no weight anywhere (only the lse variant allows one)
        for (int64_t h = 0; h < num_heads; ++h) {
          for (int64_t d = 0; d < hv; ++d) store16(out + (b * num_heads + h) * head_dim + d * 16, _mm512_setzero_ps());
          if (lse) lse[b * num_heads + h] = -INFINITY;
        }
        continue;
      }
      scores.resize(g * S);
      // Blocks sit anywhere in the pool, so the hardware prefetcher restarts at each one;
      // pull this request's K and V rows (all KV heads) into L2 ahead of the first pass.
      const int64_t row_bytes = slot_stride * static_cast<int64_t>(sizeof(T));
      auto prefetch_row = [&](const T* r) {
        for (int64_t byte = 0; byte < row_bytes; byte += 64)
          _mm_prefetch(reinterpret_cast<const char*>(r) + byte, _MM_HINT_T1);
      };
      if (b == begin)  // the thread's first request had no predecessor to fetch it
        for (int64_t s = 0; s < S; ++s) {
          prefetch_row(k_rows[s]);
          prefetch_row(v_rows[s]);
        }
      int64_t next_cursor = 0;  // next request's rows prefetched so far
      __m512 row_max[kMaxG];
      float inv_sum[kMaxG];
      const int64_t ld_p = (S + 31) / 32 * 32;  // probabilities in whole 32-position A tiles
      const int64_t blocks = (S + 15) / 16;
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        const int64_t off = kvh * head_dim;
        const T* qh = q + (b * num_heads + kvh * g) * head_dim;
        // the next request's rows, 1/num_kv_heads of them per KV head, spread evenly over
        // this head's score blocks: issued in one burst, the prefetches filled the fill
        // buffers and stalled the work behind them (AMX, 30 layers × 64 requests of ~195
        // positions, from memory: 16.5 ms spread against 18.9 in bursts)
        const int64_t quota_end = std::min(S_next, (kvh + 1) * S_next / num_kv_heads);
        const int64_t per_block = (quota_end - next_cursor + blocks - 1) / blocks;
        auto hook = [&] {
          for (int64_t n = 0; n < per_block && next_cursor < quota_end; ++n, ++next_cursor) {
            prefetch_row(next_k_rows[next_cursor]);
            prefetch_row(next_v_rows[next_cursor]);
          }
        };
        __m512 acc[kMaxG][kHeadVecs];
        for (int64_t j = 0; j < g; ++j)
          for (int64_t d = 0; d < hv; ++d) acc[j][d] = _mm512_setzero_ps();
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          // pass 1: scores and each head's max; then exp(score - max) in bf16 and 1/Σ
          if (use_amx) {
            pack_query_tiles(qh, g, head_dim, qb);
            const int64_t row_bytes = slot_stride * 2;
            switch (head_dim / 32) {
              case 1: amx_scores<1>(k_rows.data(), off, S, g, row_bytes, qb, scale, scores.data(), row_max, hook); break;
              case 2: amx_scores<2>(k_rows.data(), off, S, g, row_bytes, qb, scale, scores.data(), row_max, hook); break;
              case 3: amx_scores<3>(k_rows.data(), off, S, g, row_bytes, qb, scale, scores.data(), row_max, hook); break;
              default: amx_scores<4>(k_rows.data(), off, S, g, row_bytes, qb, scale, scores.data(), row_max, hook); break;
            }
          } else {
            switch (head_dim / 32) {
              case 1: vec_scores<1>(k_rows.data(), off, S, g, qh, head_dim, scale, scores.data(), row_max, hook); break;
              case 2: vec_scores<2>(k_rows.data(), off, S, g, qh, head_dim, scale, scores.data(), row_max, hook); break;
              case 3: vec_scores<3>(k_rows.data(), off, S, g, qh, head_dim, scale, scores.data(), row_max, hook); break;
              default: vec_scores<4>(k_rows.data(), off, S, g, qh, head_dim, scale, scores.data(), row_max, hook); break;
            }
          }
          const uint16_t* pbf = exp_to_bf16(scores.data(), S, g, row_max, ld_p, inv_sum,
                                            lse ? lse + b * num_heads + kvh * g : nullptr);  // normalised on the output
          // pass 2: weighted sum of V rows, each read once for the g query heads of this KV head
          if (use_amx) {
            for (int64_t c = 0; c < head_dim / 32; c += 2) {  // up to two 32-feature chunks per pass over V
              if (head_dim / 32 - c >= 2) amx_values_pass<2>(v_rows.data(), off, c, pbf, ld_p, S, g, acc);
              else amx_values_pass<1>(v_rows.data(), off, c, pbf, ld_p, S, g, acc);
            }
          } else {
            accumulate_values(v_rows.data(), off, pbf, ld_p, S, g, hv, acc);
          }
          for (int64_t j = 0; j < g; ++j)
            for (int64_t d = 0; d < hv; ++d) acc[j][d] = _mm512_mul_ps(acc[j][d], _mm512_set1_ps(inv_sum[j]));
        } else {
          // fp32: the scores of 16 positions at a time reduce together; softmax; V pass
          QueryF32 qv;
          for (int64_t j = 0; j < g; ++j) {
            qv.load(qh + j * head_dim, head_dim);
            float* sc = scores.data() + j * S;
            const int64_t s_vec = S / 16 * 16;
            for (int64_t s0 = 0; s0 < s_vec; s0 += 16) {
              if (j == 0) hook();
              for (int k = 0; k < 16; ++k) dots[slot16(k)] = qv.dot(k_rows[s0 + k] + off);
              _mm512_storeu_ps(sc + s0, _mm512_mul_ps(transpose_sum16(dots), _mm512_set1_ps(scale)));
            }
            if (s_vec < S && j == 0) hook();
            for (int64_t s = s_vec; s < S; ++s) sc[s] = _mm512_reduce_add_ps(qv.dot(k_rows[s] + off)) * scale;
            const float row_lse = softmax_inplace(sc, S);
            if (lse) lse[b * num_heads + kvh * g + j] = row_lse;
          }
          accumulate_values(v_rows.data(), off, scores.data(), S, g, hv, acc);
        }
        for (int64_t j = 0; j < g; ++j)
          for (int64_t d = 0; d < hv; ++d) store16(out + (b * num_heads + kvh * g + j) * head_dim + d * 16, acc[j][d]);
      }
    }
    if (use_amx) _tile_release();
  });
}

// ---- int8 pools (AVX512; never AMX) ----
//
// K and V rows are int8 with an fp32 scale per (position, KV head), the rule of
// kvserve/attention/kv_pool.py quantize_kv. Scores: the 16 K rows of a block of one KV head
// are widened once into an L1 buffer in the query's dtype (exact: |q| <= 127 fits bf16's 8
// significant bits), each query head dots them as bf16 / fp32 queries do, and the K scale
// (times the softmax scale) multiplies the 16 sums: the scale is folded into the score.
// Values: the fp32 probabilities (not rounded to bf16) times the V scale weight the V rows,
// widened int8 → fp32 in registers once per group of query heads. Both passes prefetch
// their rows two blocks ahead, so a single request (batch 1) streams the pool instead of
// waiting at each block's first row. A query's positions go
// in order and nothing in its sums depends on the other requests of the call, so a query
// gets the same output alone or in any batch.

inline __m512 widen_f32(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// One query head against widened K rows of 32·C features: dpbf16 pairs for bf16 queries,
// fp32 FMAs for fp32 ones; 16 partial sums for transpose_sum16.
template <typename T, int C>
struct QueryInt8Dot;

template <int C>
struct QueryInt8Dot<at::BFloat16, C> {
  using Row = at::BFloat16;
  __m512bh v[C];
  void load(const at::BFloat16* q) {
    for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_si512(q + c * 32);
  }
  __m512 dot(const at::BFloat16* k) const {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), v[0], (__m512bh)_mm512_load_si512(k));
#pragma GCC unroll 4
    for (int c = 1; c < C; ++c) acc = _mm512_dpbf16_ps(acc, v[c], (__m512bh)_mm512_load_si512(k + c * 32));
    return acc;
  }
  // 32 int8 → 32 bf16, the first 16 in the low half as dpbf16 pairs them with the query
  static void widen(const int8_t* src, at::BFloat16* dst) {
    _mm512_store_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(widen_f32(src + 16), widen_f32(src)));
  }
};

template <int C>
struct QueryInt8Dot<float, C> {
  __m512 v[2 * C];
  void load(const float* q) {
    for (int c = 0; c < 2 * C; ++c) v[c] = _mm512_loadu_ps(q + c * 16);
  }
  __m512 dot(const float* k) const {
    __m512 acc = _mm512_mul_ps(v[0], _mm512_load_ps(k));
#pragma GCC unroll 8
    for (int c = 1; c < 2 * C; ++c) acc = _mm512_fmadd_ps(v[c], _mm512_load_ps(k + c * 16), acc);
    return acc;
  }
  static void widen(const int8_t* src, float* dst) {
    _mm512_store_ps(dst, widen_f32(src));
    _mm512_store_ps(dst + 16, widen_f32(src + 16));
  }
};

// positions ahead of the one being read whose rows the int8 passes prefetch
constexpr int64_t kInt8PrefetchAhead = 32;

// Where one request's rows are: its positions' slots, and the pools they index.
struct Int8Rows {
  const int8_t *k, *v;       // pools [slots, N_kv, H]
  const float *ks, *vs;      // scales [slots, N_kv]
  const int64_t* slots;      // the request's S slots, in position order
  int64_t slot_stride;       // N_kv·H bytes per slot
  int64_t num_kv_heads;
};

// sc[j·S + s] = scale · k_scale[s] · q_j·k_s for the g heads of KV head `kvh`, row_max[j]
// for the softmax, vscale[s] = the V scales gathered in position order; `hook` after each
// block's widening (the caller's prefetches of the next request).
template <typename T, int C, typename Hook>
void int8_scores(const Int8Rows& r, int64_t kvh, int64_t S, int64_t g, const T* q, float scale, float* sc,
                 float* vscale, __m512* row_max, Hook&& hook) {
  constexpr int D = 32 * C;
  alignas(64) T kb[16 * D];
  alignas(64) float kscale[16];
  const int64_t off = kvh * D;
  for (int64_t j = 0; j < g; ++j) row_max[j] = _mm512_set1_ps(-INFINITY);
  for (int64_t s0 = 0; s0 < S; s0 += 16) {
    const int64_t live = std::min<int64_t>(16, S - s0);
    // this head's K lines two blocks ahead (a block's 16 slots are one run of the pool, the
    // next block anywhere: the hardware prefetcher would restart at each)
    for (int64_t k = s0 + kInt8PrefetchAhead, e = std::min(S, k + 16); k < e; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(r.k + r.slots[k] * r.slot_stride + off), _MM_HINT_T0);
      if constexpr (C > 2) _mm_prefetch(reinterpret_cast<const char*>(r.k + r.slots[k] * r.slot_stride + off + 64), _MM_HINT_T0);
    }
    for (int64_t k = 0; k < 16; ++k) {
      if (k < live) {
        const int64_t slot = r.slots[s0 + k];
        const int8_t* row = r.k + slot * r.slot_stride + off;
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) QueryInt8Dot<T, C>::widen(row + c * 32, kb + k * D + c * 32);
        kscale[k] = r.ks[slot * r.num_kv_heads + kvh] * scale;
        vscale[s0 + k] = r.vs[slot * r.num_kv_heads + kvh];
      } else {  // past S: zeros, their sums masked off below
        std::memset(static_cast<void*>(kb + k * D), 0, sizeof(T) * D);
        kscale[k] = 0.f;
      }
    }
    hook();
    const __m512 kscale_v = _mm512_load_ps(kscale);
    const __mmask16 mask = live == 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
    for (int64_t j = 0; j < g; ++j) {
      QueryInt8Dot<T, C> qv;
      qv.load(q + j * D);
      __m512 dots[16];
#pragma GCC unroll 16
      for (int k = 0; k < 16; ++k) dots[slot16(k)] = qv.dot(kb + k * D);
      const __m512 v = _mm512_mul_ps(transpose_sum16(dots), kscale_v);
      _mm512_mask_storeu_ps(sc + j * S + s0, mask, v);
      row_max[j] = _mm512_mask_max_ps(row_max[j], mask, row_max[j], v);
    }
  }
}

// p[j·S + s] = softmax_j(s) · vscale[s] in place, in two passes (the max came from int8_scores);
// with `lse`, lse[j] = max + log Σ e^(s - max) of head j
inline void int8_softmax(float* sc, const float* vscale, int64_t S, int64_t g, const __m512* row_max,
                         float* lse = nullptr) {
  const int64_t nv = S / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (S - nv)) - 1);
  for (int64_t j = 0; j < g; ++j) {
    float* p = sc + j * S;
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(row_max[j]));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t s = 0; s < nv; s += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + s), mx));
      _mm512_storeu_ps(p + s, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (nv < S) {
      const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, p + nv), mx)));
      _mm512_mask_storeu_ps(p + nv, tail, e);
      sum = _mm512_add_ps(sum, e);
    }
    const float total = _mm512_reduce_add_ps(sum);
    if (lse) lse[j] = _mm512_reduce_max_ps(row_max[j]) + std::log(total);
    const __m512 inv = _mm512_set1_ps(1.f / total);
    for (int64_t s = 0; s < nv; s += 16)
      _mm512_storeu_ps(p + s, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(p + s), inv), _mm512_loadu_ps(vscale + s)));
    if (nv < S)
      _mm512_mask_storeu_ps(p + nv, tail, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, p + nv), inv),
                                                         _mm512_maskz_loadu_ps(tail, vscale + nv)));
  }
}

// acc[j] = Σ_s p_j[s]·V[s] for `gcount` (<= G) heads of KV head `kvh`, p rows S apart (the V
// scale already in p, int8_softmax); 2·C·G fp32 accumulators and the 2·C widened V vectors
// stay in registers.
template <int G, int C>
void int8_values(const Int8Rows& r, int64_t kvh, const float* p, int64_t S, int64_t gcount, __m512 (*acc)[kHeadVecs]) {
  constexpr int V = 2 * C;
  __m512 a[G][V];
#pragma GCC unroll 8
  for (int j = 0; j < G; ++j)
#pragma GCC unroll 8
    for (int d = 0; d < V; ++d) a[j][d] = _mm512_setzero_ps();
  const int64_t off = kvh * 32 * C;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t slot = r.slots[s];
    const int8_t* row = r.v + slot * r.slot_stride + off;
    if (s + kInt8PrefetchAhead < S) {  // as int8_scores does for K
      const char* ahead = reinterpret_cast<const char*>(r.v + r.slots[s + kInt8PrefetchAhead] * r.slot_stride + off);
      _mm_prefetch(ahead, _MM_HINT_T0);
      if constexpr (C > 2) _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
    __m512 vf[V];
#pragma GCC unroll 8
    for (int d = 0; d < V; ++d) vf[d] = widen_f32(row + d * 16);
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
      const __m512 pj = _mm512_set1_ps(j < gcount ? p[j * S + s] : 0.f);
#pragma GCC unroll 8
      for (int d = 0; d < V; ++d) a[j][d] = _mm512_fmadd_ps(pj, vf[d], a[j][d]);
    }
  }
  for (int j = 0; j < G && j < gcount; ++j)
    for (int d = 0; d < V; ++d) acc[j][d] = a[j][d];
}

// int8_values for the g heads, in groups whose accumulators fit the registers (of a size
// that divides g where one does, as the bf16 V pass groups them).
inline void int8_values_all(const Int8Rows& r, int64_t kvh, const float* p, int64_t S, int64_t g, int64_t chunks,
                            __m512 (*acc)[kHeadVecs]) {
  const int64_t group = value_head_group(g, chunks);
  for (int64_t j0 = 0; j0 < g; j0 += group) {
    const int64_t n = std::min(group, g - j0);
    const float* pj = p + j0 * S;
    __m512 (*a)[kHeadVecs] = acc + j0;
    switch (chunks * 16 + group) {
      case 16 + 8: int8_values<8, 1>(r, kvh, pj, S, n, a); break;
      case 16 + 7: int8_values<7, 1>(r, kvh, pj, S, n, a); break;
      case 16 + 6: int8_values<6, 1>(r, kvh, pj, S, n, a); break;
      case 16 + 5: int8_values<5, 1>(r, kvh, pj, S, n, a); break;
      case 16 + 4: int8_values<4, 1>(r, kvh, pj, S, n, a); break;
      case 16 + 3: int8_values<3, 1>(r, kvh, pj, S, n, a); break;
      case 16 + 2: int8_values<2, 1>(r, kvh, pj, S, n, a); break;
      case 16 + 1: int8_values<1, 1>(r, kvh, pj, S, n, a); break;
      case 32 + 4: int8_values<4, 2>(r, kvh, pj, S, n, a); break;
      case 32 + 3: int8_values<3, 2>(r, kvh, pj, S, n, a); break;
      case 32 + 2: int8_values<2, 2>(r, kvh, pj, S, n, a); break;
      case 32 + 1: int8_values<1, 2>(r, kvh, pj, S, n, a); break;
      case 48 + 2: int8_values<2, 3>(r, kvh, pj, S, n, a); break;
      case 48 + 1: int8_values<1, 3>(r, kvh, pj, S, n, a); break;
      case 64 + 2: int8_values<2, 4>(r, kvh, pj, S, n, a); break;
      case 64 + 1: int8_values<1, 4>(r, kvh, pj, S, n, a); break;
      default: TORCH_CHECK(false, "int8 decode attention: no V kernel for ", chunks, " chunks in groups of ", group);
    }
  }
}

// Request b over its positions [start_positions[b], context_lens[b]) (from 0 without
// start_positions); with `lse`, each head's log-sum-exp (-inf and a zero output for an empty
// range), as decode_attention_impl.
template <typename T, typename OutT = T>
void decode_attention_int8_impl(const T* q, const int8_t* k_pool, const int8_t* v_pool, const float* k_scale,
                                const float* v_scale, const int32_t* block_tables, const int32_t* context_lens, OutT* out,
                                int64_t B, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                int64_t max_blocks, float scale, const int32_t* start_positions = nullptr,
                                float* lse = nullptr) {
  const int64_t g = num_heads / num_kv_heads;
  TORCH_CHECK(g <= kMaxG, "paged_decode_attention: at most ", kMaxG, " query heads per KV head, got ", g);
  TORCH_CHECK(head_dim % kDecodeAttentionHeadDimMultipleBf16 == 0, "int8 decode attention: head_dim % ",
              kDecodeAttentionHeadDimMultipleBf16, " == 0");
  const int64_t slot_stride = num_kv_heads * head_dim, chunks = head_dim / 32, hv = head_dim / 16;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots, next_slots;
    std::vector<float> scores, vscale;
    auto slot_list = [&](int64_t req, std::vector<int64_t>& out_slots) {
      const int64_t first = start_positions ? start_positions[req] : 0;
      const int64_t S = context_lens[req] - first;
      const int32_t* table = block_tables + req * max_blocks;
      out_slots.resize(S);
      for (int64_t s = 0, blk = first / block_size, o0 = first % block_size; s < S; ++blk, o0 = 0)
        for (int64_t o = o0, base = static_cast<int64_t>(table[blk]) * block_size; o < block_size && s < S; ++o, ++s)
          out_slots[s] = base + o;
    };
    // a slot's K and V rows and scales into L2 (blocks sit anywhere: the hardware prefetcher restarts at each)
    auto prefetch_slot = [&](int64_t slot) {
      for (int64_t byte = 0; byte < slot_stride; byte += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(k_pool + slot * slot_stride) + byte, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(v_pool + slot * slot_stride) + byte, _MM_HINT_T1);
      }
      _mm_prefetch(reinterpret_cast<const char*>(k_scale + slot * num_kv_heads), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(v_scale + slot * num_kv_heads), _MM_HINT_T1);
    };
    if (begin < end) slot_list(begin, next_slots);
    for (int64_t b = begin; b < end; ++b) {
      std::swap(slots, next_slots);
      if (b + 1 < end) slot_list(b + 1, next_slots);
      else next_slots.clear();
      const int64_t S = static_cast<int64_t>(slots.size()), S_next = static_cast<int64_t>(next_slots.size());
      if (S == 0) {  // an empty range: no weight anywhere (only the lse variant allows one)
        for (int64_t h = 0; h < num_heads; ++h) {
          for (int64_t d = 0; d < hv; ++d) store16(out + (b * num_heads + h) * head_dim + d * 16, _mm512_setzero_ps());
          if (lse) lse[b * num_heads + h] = -INFINITY;
        }
        continue;
      }
      scores.resize(g * S);
      vscale.resize(S);
      if (b == begin)
        for (int64_t s = 0; s < S; ++s) prefetch_slot(slots[s]);
      const Int8Rows rows{k_pool, v_pool, k_scale, v_scale, slots.data(), slot_stride, num_kv_heads};
      const int64_t blocks = (S + 15) / 16;
      int64_t next_cursor = 0;
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        // the next request's rows, spread over this request's score blocks (see the bf16 path)
        const int64_t quota_end = std::min(S_next, (kvh + 1) * S_next / num_kv_heads);
        const int64_t per_block = (quota_end - next_cursor + blocks - 1) / blocks;
        auto hook = [&] {
          for (int64_t n = 0; n < per_block && next_cursor < quota_end; ++n) prefetch_slot(next_slots[next_cursor++]);
        };
        const T* qh = q + (b * num_heads + kvh * g) * head_dim;
        __m512 row_max[kMaxG];
        switch (chunks) {
          case 1: int8_scores<T, 1>(rows, kvh, S, g, qh, scale, scores.data(), vscale.data(), row_max, hook); break;
          case 2: int8_scores<T, 2>(rows, kvh, S, g, qh, scale, scores.data(), vscale.data(), row_max, hook); break;
          case 3: int8_scores<T, 3>(rows, kvh, S, g, qh, scale, scores.data(), vscale.data(), row_max, hook); break;
          default: int8_scores<T, 4>(rows, kvh, S, g, qh, scale, scores.data(), vscale.data(), row_max, hook); break;
        }
        int8_softmax(scores.data(), vscale.data(), S, g, row_max, lse ? lse + b * num_heads + kvh * g : nullptr);
        __m512 acc[kMaxG][kHeadVecs];
        int8_values_all(rows, kvh, scores.data(), S, g, chunks, acc);
        for (int64_t j = 0; j < g; ++j)
          for (int64_t d = 0; d < hv; ++d) store16(out + (b * num_heads + kvh * g + j) * head_dim + d * 16, acc[j][d]);
      }
    }
  });
}

}  // namespace

// q: [B, N_q, H]; pools: [num_blocks, block_size, N_kv, H]; block_tables: [B, max_blocks] int32;
// context_lens: [B] int32 (S0 + 1, the new position's K/V already written). Returns [B, N_q, H].
// int8 pools come with their scales k_scale / v_scale [num_blocks, block_size, N_kv] fp32.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                  at::Tensor block_tables, at::Tensor context_lens, double scale,
                                  c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale) {
  // a profiler range (nothing when no profiler runs): `kvserve bench throughput
  // --profile-attention` sums these per decode step, inside the fused step too
  RECORD_FUNCTION(kDecodeAttentionRange, std::vector<c10::IValue>());
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4, "paged_decode_attention: shapes");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt, "int32 tables");
  if (k_pool.scalar_type() == at::kChar) {
    check_int8_pools(k_pool, v_pool, k_scale, v_scale, "paged_decode_attention");
    const int64_t head_dim = q.size(2);
    TORCH_CHECK(head_dim % kDecodeAttentionHeadDimMultipleBf16 == 0 && head_dim <= kDecodeAttentionMaxHeadDim,
                "paged_decode_attention: int8 head_dim must be a multiple of ", kDecodeAttentionHeadDimMultipleBf16,
                ", at most ", kDecodeAttentionMaxHeadDim, ", got ", head_dim);
    q = q.contiguous();
    block_tables = block_tables.contiguous();
    context_lens = context_lens.contiguous();
    auto out = at::empty_like(q);
    const int64_t B = q.size(0), num_heads = q.size(1), num_kv_heads = k_pool.size(2), block_size = k_pool.size(1);
    auto run = [&](auto tag) {
      using T = decltype(tag);
      decode_attention_int8_impl<T>(q.data_ptr<T>(), k_pool.data_ptr<int8_t>(), v_pool.data_ptr<int8_t>(),
                                    k_scale->data_ptr<float>(), v_scale->data_ptr<float>(), block_tables.data_ptr<int32_t>(),
                                    context_lens.data_ptr<int32_t>(), out.data_ptr<T>(), B, num_heads, num_kv_heads, head_dim,
                                    block_size, block_tables.size(1), static_cast<float>(scale));
    };
    if (q.scalar_type() == at::kBFloat16) run(at::BFloat16{});
    else if (q.scalar_type() == at::kFloat) run(float{});
    else TORCH_CHECK(false, "paged_decode_attention: bf16 or fp32 queries");
    return out;
  }
  TORCH_CHECK(!k_scale && !v_scale, "paged_decode_attention: scales are for int8 pools only");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(), "dtypes");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim % kDecodeAttentionHeadDimMultipleFp32 == 0 && head_dim <= kDecodeAttentionMaxHeadDim,
              "paged_decode_attention: head_dim must be a multiple of ", kDecodeAttentionHeadDimMultipleFp32,
              ", at most ", kDecodeAttentionMaxHeadDim, ", got ", head_dim);
  TORCH_CHECK(q.scalar_type() != at::kBFloat16 || head_dim % kDecodeAttentionHeadDimMultipleBf16 == 0,
              "paged_decode_attention: bf16 head_dim must be a multiple of ", kDecodeAttentionHeadDimMultipleBf16,
              ", got ", head_dim);
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = at::empty_like(q);
  const int64_t B = q.size(0), num_heads = q.size(1), num_kv_heads = k_pool.size(2), block_size = k_pool.size(1);
  if (q.scalar_type() == at::kBFloat16) {
    // AMX scores need whole 16-position blocks (a block's unused slots are read, never used)
    const bool use_amx = block_size % 16 == 0 && amx_available();
    decode_attention_impl<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>(),
                                        block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), out.data_ptr<at::BFloat16>(),
                                        B, num_heads, num_kv_heads, head_dim, block_size, block_tables.size(1), static_cast<float>(scale),
                                        use_amx);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "bf16 or fp32");
    decode_attention_impl<float>(q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                                 block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), out.data_ptr<float>(),
                                 B, num_heads, num_kv_heads, head_dim, block_size, block_tables.size(1), static_cast<float>(scale),
                                 false);
  }
  return out;
}

// The suffix half of shared-prefix attention: row b attends to its positions
// [start_positions[b], context_lens[b]) only. Returns (out [B, N_q, H] fp32, normalised;
// lse [B, N_q] fp32, max + log Σ exp(scale·q·k)); an empty range gives out 0, lse -inf.
// bf16 or fp32 queries and pools (int8 pools are refused here).
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_lse(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                                              at::Tensor block_tables, at::Tensor context_lens,
                                                              at::Tensor start_positions, double scale,
                                                              c10::optional<at::Tensor> k_scale,
                                                              c10::optional<at::Tensor> v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4, "paged_decode_attention_lse: shapes");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  start_positions.scalar_type() == at::kInt, "paged_decode_attention_lse: int32 tables");
  const bool int8 = k_pool.scalar_type() == at::kChar;
  if (int8)
    check_int8_pools(k_pool, v_pool, k_scale, v_scale, "paged_decode_attention_lse");
  else
    TORCH_CHECK(!k_scale && !v_scale, "paged_decode_attention_lse: scales are for int8 pools only");
  TORCH_CHECK(int8 || (q.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type()), "dtypes");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim % kDecodeAttentionHeadDimMultipleFp32 == 0 && head_dim <= kDecodeAttentionMaxHeadDim,
              "paged_decode_attention_lse: head_dim must be a multiple of ", kDecodeAttentionHeadDimMultipleFp32,
              ", at most ", kDecodeAttentionMaxHeadDim, ", got ", head_dim);
  TORCH_CHECK(q.scalar_type() != at::kBFloat16 || head_dim % kDecodeAttentionHeadDimMultipleBf16 == 0,
              "paged_decode_attention_lse: bf16 head_dim must be a multiple of ", kDecodeAttentionHeadDimMultipleBf16);
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  start_positions = start_positions.contiguous();
  const int64_t B = q.size(0), num_heads = q.size(1), num_kv_heads = k_pool.size(2), block_size = k_pool.size(1);
  TORCH_CHECK(context_lens.numel() == B && start_positions.numel() == B && block_tables.size(0) == B,
              "paged_decode_attention_lse: one table, length and start per row");
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* starts = start_positions.data_ptr<int32_t>();
  bool aligned = true;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(0 <= starts[b] && starts[b] <= lens[b] && lens[b] <= block_tables.size(1) * block_size,
                "paged_decode_attention_lse: row ", b, " needs 0 <= start <= len <= its table's positions");
    aligned = aligned && starts[b] % 16 == 0;
  }
  auto out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  auto lse = at::empty({B, num_heads}, q.options().dtype(at::kFloat));
  if (int8) {
    auto run = [&](auto tag) {
      using T = decltype(tag);
      decode_attention_int8_impl<T, float>(q.data_ptr<T>(), k_pool.data_ptr<int8_t>(), v_pool.data_ptr<int8_t>(),
                                           k_scale->data_ptr<float>(), v_scale->data_ptr<float>(),
                                           block_tables.data_ptr<int32_t>(), lens, out.data_ptr<float>(), B, num_heads,
                                           num_kv_heads, head_dim, block_size, block_tables.size(1),
                                           static_cast<float>(scale), starts, lse.data_ptr<float>());
    };
    if (q.scalar_type() == at::kBFloat16) run(at::BFloat16{});
    else if (q.scalar_type() == at::kFloat) run(float{});
    else TORCH_CHECK(false, "paged_decode_attention_lse: bf16 or fp32 queries");
  } else if (q.scalar_type() == at::kBFloat16) {
    // AMX score tiles read 16 consecutive slots: starts on a 16-position boundary only
    const bool use_amx = aligned && block_size % 16 == 0 && amx_available();
    decode_attention_impl<at::BFloat16, float>(q.data_ptr<at::BFloat16>(), k_pool.data_ptr<at::BFloat16>(),
                                               v_pool.data_ptr<at::BFloat16>(), block_tables.data_ptr<int32_t>(), lens,
                                               out.data_ptr<float>(), B, num_heads, num_kv_heads, head_dim, block_size,
                                               block_tables.size(1), static_cast<float>(scale), use_amx, starts,
                                               lse.data_ptr<float>());
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "bf16 or fp32");
    decode_attention_impl<float, float>(q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                                        block_tables.data_ptr<int32_t>(), lens, out.data_ptr<float>(), B, num_heads,
                                        num_kv_heads, head_dim, block_size, block_tables.size(1),
                                        static_cast<float>(scale), false, starts, lse.data_ptr<float>());
  }
  return {out, lse};
}
