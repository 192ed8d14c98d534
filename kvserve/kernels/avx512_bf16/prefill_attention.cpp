// Causal attention for the prompt tokens of a step (bf16; AMX tiles, or AVX512-BF16 dot
// products on CPUs without AMX), read from the paged
// KV pool: each segment's m new queries attend to its S0 cached + m new positions, query
// S0 + i seeing keys 0..S0 + i.
//
// Why our own: SDPA's CPU kernel runs the bf16 causal case of 16 prompts × 128 tokens at
// ~130 GFLOP/s (3-4.5 ms per layer here), a sixth of a prefill step, while the same
// products on AMX tiles run several times faster. It also needs K/V gathered out of the
// pool and repeated to the query heads first; this reads the pool through the slots.
//
// Two phases:
//   1. per (segment, KV head), K and V are packed once into TDPBF16PS's B layout:
//      K as [key block of 16][feature chunk of 32] tiles, (kp, n) = K[n][2kp, 2kp + 1],
//      so S = Q·Kᵀ takes Q rows straight from q; V as [key block of 32][feature chunk of
//      16] tiles, (kp, n) = (V[2kp][n], V[2kp + 1][n]), so O = P·V takes P rows as A.
//      Positions past the context are zero, so padded products add nothing (not NaN).
//   2. per (segment, query head, block of 16 queries): scores against every key block the
//      block can see, a row-wise causal softmax in fp32 (probabilities rounded to bf16 once,
//      as the decode kernel does), then P·V into four C tiles at a time.
//
// int8 pools (a scale per position and KV head, kvserve/attention/kv_pool.py quantize_kv) are
// packed into the same tiles, each int8 as the bf16 of the same value (exact: |q| <= 127),
// and their scales are kept per (segment, KV head) beside them: the K scale multiplies each
// key's score before the softmax, the V scale each key's probability before it is rounded
// to bf16. So the products, AMX or AVX512, read the same tiles as for bf16 pools.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/bit_cast.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "../kernels.h"
#include "vec_math.h"

KVSERVE_KERNEL_FAMILY("prefill_attention");

namespace {

constexpr int kQueries = 16;   // queries per work unit: the rows of an A tile
constexpr int kKeyBlock = 16;  // keys per S tile (columns of the K tile)
constexpr int kKeyPair = 32;   // keys per P·V step (K depth of the V tile)

// Packed K/V of one (segment, KV head): offsets into the shared buffer, in uint32 pairs;
// for int8 pools also its keys' K and V scales (fp32, ctx of each rounded up to 32 keys).
struct PackedKV {
  int64_t k_offset, v_offset, scale_offset;
};

// the bf16 bits of an int8 value (exact)
inline uint32_t int8_bf16(int8_t v) { return c10::bit_cast<uint32_t>(static_cast<float>(v)) >> 16; }

// pack_keys for int8 pools: the same tiles, each element the bf16 of its int8 value
void pack_keys_int8(const int8_t* k_pool, int64_t row_elems, int64_t head, const int64_t* slots, int64_t ctx, int64_t D,
                    uint32_t* out) {
  const int64_t chunks = D / 32, blocks = (ctx + kKeyBlock - 1) / kKeyBlock;
  for (int64_t j = 0; j < blocks; ++j)
    for (int n = 0; n < kKeyBlock; ++n) {
      const int64_t key = j * kKeyBlock + n;
      const int8_t* row = key < ctx ? k_pool + slots[key] * row_elems + head * D : nullptr;
      for (int64_t c = 0; c < chunks; ++c) {
        uint32_t* tile = out + (j * chunks + c) * 256;
        for (int kp = 0; kp < 16; ++kp)
          tile[kp * 16 + n] = row ? int8_bf16(row[c * 32 + 2 * kp]) | (int8_bf16(row[c * 32 + 2 * kp + 1]) << 16) : 0u;
      }
    }
}

// pack_values for int8 pools
void pack_values_int8(const int8_t* v_pool, int64_t row_elems, int64_t head, const int64_t* slots, int64_t ctx,
                      int64_t D, uint32_t* out) {
  const int64_t chunks = D / 16, blocks = (ctx + kKeyPair - 1) / kKeyPair;
  for (int64_t j = 0; j < blocks; ++j)
    for (int kp = 0; kp < 16; ++kp) {
      const int64_t k0 = j * kKeyPair + 2 * kp, k1 = k0 + 1;
      const int8_t* r0 = k0 < ctx ? v_pool + slots[k0] * row_elems + head * D : nullptr;
      const int8_t* r1 = k1 < ctx ? v_pool + slots[k1] * row_elems + head * D : nullptr;
      for (int64_t c = 0; c < chunks; ++c) {
        uint32_t* row = out + ((j * chunks + c) * 16 + kp) * 16;
        for (int f = 0; f < 16; ++f) {
          const uint32_t lo = r0 ? int8_bf16(r0[c * 16 + f]) : 0u, hi = r1 ? int8_bf16(r1[c * 16 + f]) : 0u;
          row[f] = lo | (hi << 16);
        }
      }
    }
}

// K rows (slots[0..ctx)) of one KV head → [ceil(ctx/16)][D/32][16 kp][16 keys] pairs.
void pack_keys(const uint32_t* k_pool, int64_t row_pairs, int64_t head, const int64_t* slots, int64_t ctx,
               int64_t D, uint32_t* out) {
  const int64_t chunks = D / 32, blocks = (ctx + kKeyBlock - 1) / kKeyBlock, half = D / 2;
  for (int64_t j = 0; j < blocks; ++j)
    for (int n = 0; n < kKeyBlock; ++n) {
      const int64_t key = j * kKeyBlock + n;
      const uint32_t* row = key < ctx ? k_pool + slots[key] * row_pairs + head * half : nullptr;
      for (int64_t c = 0; c < chunks; ++c) {
        uint32_t* tile = out + (j * chunks + c) * 256;
        for (int kp = 0; kp < 16; ++kp) tile[kp * 16 + n] = row ? row[c * 16 + kp] : 0u;
      }
    }
}

// V rows of one KV head → [ceil(ctx/32)][D/16][16 kp][16 features] pairs (V[2kp][f], V[2kp+1][f]).
void pack_values(const uint16_t* v_pool, int64_t row_elems, int64_t head, const int64_t* slots, int64_t ctx,
                 int64_t D, uint32_t* out) {
  const int64_t chunks = D / 16, blocks = (ctx + kKeyPair - 1) / kKeyPair;
  for (int64_t j = 0; j < blocks; ++j)
    for (int kp = 0; kp < 16; ++kp) {
      const int64_t k0 = j * kKeyPair + 2 * kp, k1 = k0 + 1;
      const uint16_t* r0 = k0 < ctx ? v_pool + slots[k0] * row_elems + head * D : nullptr;
      const uint16_t* r1 = k1 < ctx ? v_pool + slots[k1] * row_elems + head * D : nullptr;
      for (int64_t c = 0; c < chunks; ++c) {
        uint32_t* row = out + ((j * chunks + c) * 16 + kp) * 16;
        for (int f = 0; f < 16; ++f) {
          const uint32_t lo = r0 ? r0[c * 16 + f] : 0u, hi = r1 ? r1[c * 16 + f] : 0u;
          row[f] = lo | (hi << 16);
        }
      }
    }
}

// C tiles 0..group-1 (group <= 4) = Σ over `steps` of A(step) · B_i(step), the tile shape
// both products of a unit share. Step t loads one A tile (16 rows of 32 bf16 at
// a + t·a_step, rows a_stride bytes apart) that feeds every product, and the B tiles
// b + t·b_step + i·b_next (packed pairs, 1 KiB each), alternating between tiles 6 and 7 so a
// load never waits on the product still reading the other. C tile i goes to out + 16 i,
// rows out_ld bytes apart.
//
// Steps from t2 on read their B tiles from b2 + (t - t2)·b_step instead (a shared prefix's
// tiles packed by another segment, then this segment's own): the same sums in the same order.
void four_products(const uint16_t* a, int64_t a_step, int64_t a_stride, const uint32_t* b, int64_t b_step,
                   int64_t b_next, int64_t steps, int64_t group, float* out, int64_t out_ld, const uint32_t* b2,
                   int64_t t2) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t t = 0; t < steps; ++t) {
    _tile_loadd(4, a + t * a_step, a_stride);
    const uint32_t* bt = t < t2 ? b + t * b_step : b2 + (t - t2) * b_step;
    _tile_loadd(6, bt, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (group > 1) {
      _tile_loadd(7, bt + b_next, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (group > 2) {
      _tile_loadd(6, bt + 2 * b_next, 64);
      _tile_dpbf16ps(2, 4, 6);
    }
    if (group > 3) {
      _tile_loadd(7, bt + 3 * b_next, 64);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  _tile_stored(0, out, out_ld);
  if (group > 1) _tile_stored(1, out + 16, out_ld);
  if (group > 2) _tile_stored(2, out + 32, out_ld);
  if (group > 3) _tile_stored(3, out + 48, out_ld);
}

// four_products without AMX, on AVX512-BF16: each of the 16 kp rows of a packed B tile is
// one vector of 16 columns' pairs, so a pair of A (two bf16, broadcast) times that row is
// one VDPBF16PS, and the packed layouts serve both paths. Four A rows at a time keep 4·G
// accumulators in registers (16 for G = 4) while B streams from L1/L2.
template <int G>
void vec_products_g(const uint16_t* a, int64_t a_step, int64_t a_stride, const uint32_t* b, int64_t b_step,
                    int64_t b_next, int64_t steps, float* out, int64_t out_ld, const uint32_t* b2, int64_t t2) {
  constexpr int R = 4;
  const auto* a_bytes = reinterpret_cast<const char*>(a);
  for (int r0 = 0; r0 < kQueries; r0 += R) {
    __m512 acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < G; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < steps; ++t) {
      const uint32_t* bt = t < t2 ? b + t * b_step : b2 + (t - t2) * b_step;
      const char* at = a_bytes + t * a_step * 2 + r0 * a_stride;
      for (int kp = 0; kp < 16; ++kp) {
        __m512bh bv[G];
        for (int i = 0; i < G; ++i) bv[i] = (__m512bh)_mm512_loadu_si512(bt + i * b_next + kp * 16);
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, at + r * a_stride + kp * 4, sizeof(pair));
          const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
          for (int i = 0; i < G; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], av, bv[i]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < G; ++i)
        _mm512_storeu_ps(reinterpret_cast<float*>(reinterpret_cast<char*>(out) + (r0 + r) * out_ld) + 16 * i, acc[r][i]);
  }
}

void vec_products(const uint16_t* a, int64_t a_step, int64_t a_stride, const uint32_t* b, int64_t b_step,
                  int64_t b_next, int64_t steps, int64_t group, float* out, int64_t out_ld, const uint32_t* b2,
                  int64_t t2) {
  switch (group) {
    case 1: vec_products_g<1>(a, a_step, a_stride, b, b_step, b_next, steps, out, out_ld, b2, t2); break;
    case 2: vec_products_g<2>(a, a_step, a_stride, b, b_step, b_next, steps, out, out_ld, b2, t2); break;
    case 3: vec_products_g<3>(a, a_step, a_stride, b, b_step, b_next, steps, out, out_ld, b2, t2); break;
    default: vec_products_g<4>(a, a_step, a_stride, b, b_step, b_next, steps, out, out_ld, b2, t2); break;
  }
}

using ProductsFn = void (*)(const uint16_t*, int64_t, int64_t, const uint32_t*, int64_t, int64_t, int64_t, int64_t,
                            float*, int64_t, const uint32_t*, int64_t);

// A segment's packed K (or V) tiles: positions before `shared_keys` from `shared` (the tiles
// its leader packed), the rest from `own` (packed from position shared_keys on).
struct TileSource {
  const uint32_t* shared;
  const uint32_t* own;
  int64_t shared_keys;
};

// S[16][ld] (fp32) = Q tile rows · Kᵀ for key blocks [0, blocks), four blocks per pass over
// Q's chunks. Q's chunk tiles come from `qa` (16 rows, `q_stride` bytes apart), the K tiles
// from `kp` (packed by pack_keys: [block][chunk] tiles).
// With a shared part (its length a multiple of 4 key blocks), the groups of 4 blocks before it
// read the shared tiles and the rest the segment's own; each score is one product either way.
void block_scores(ProductsFn products, const uint16_t* qa, int64_t q_stride, const TileSource& kp, int64_t chunks,
                  int64_t blocks, float* s, int64_t ld) {
  const int64_t shared_blocks = kp.shared_keys / kKeyBlock;
  for (int64_t j0 = 0; j0 < blocks; j0 += 4) {
    const uint32_t* tiles = j0 < shared_blocks ? kp.shared + j0 * chunks * 256 : kp.own + (j0 - shared_blocks) * chunks * 256;
    products(qa, 32, q_stride, tiles, 256, chunks * 256, chunks, std::min<int64_t>(4, blocks - j0), s + j0 * kKeyBlock,
             ld * 4, nullptr, chunks);
  }
}

// Row r of S: scale, softmax over its first `visible` keys, bf16 probabilities into p (zeros
// after, up to `width`, a multiple of 32). The row is overwritten with the exponentials.
// Scaled (int8 pools): key k's score is first multiplied by ks[k] (in place), its
// probability by vs[k] before rounding (ks, vs >= 0).
template <bool Scaled>
void softmax_row(float* s, int64_t visible, int64_t width, float scale, uint16_t* p, const float* ks = nullptr,
                 const float* vs = nullptr) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t k = 0;
  const __mmask16 tail = static_cast<__mmask16>((1u << ((visible - visible / 16 * 16))) - 1);
  if constexpr (Scaled) {
    for (int64_t i = 0; i < visible; i += 16) {
      const __mmask16 m = i + 16 <= visible ? __mmask16(0xFFFF) : tail;
      _mm512_mask_storeu_ps(s + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + i), _mm512_maskz_loadu_ps(m, ks + i)));
    }
  }
  for (; k + 16 <= visible; k += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + k));
  if (k < visible) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + k));
  const __m512 mxs = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale);
  // two passes over the row: e^(s·scale − max) in place, then normalise and round
  float* e = s;
  __m512 sum = _mm512_setzero_ps();
  for (k = 0; k + 16 <= visible; k += 16) {
    const __m512 v = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + k), sc, mxs));
    _mm512_storeu_ps(e + k, v);
    sum = _mm512_add_ps(sum, v);
  }
  if (k < visible) {
    const __m512 v = _mm512_maskz_mov_ps(tail, exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(tail, s + k), sc, mxs)));
    _mm512_storeu_ps(e + k, v);  // lanes past `visible` are zero
    sum = _mm512_add_ps(sum, v);
    k += 16;
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  int64_t done = 0;
  for (; done < k; done += 16) {
    __m512 prob = _mm512_mul_ps(_mm512_loadu_ps(e + done), inv);
    if constexpr (Scaled) prob = _mm512_mul_ps(prob, _mm512_loadu_ps(vs + done));  // vs: whole 32-key rows
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + done), (__m256i)_mm512_cvtneps_pbh(prob));
  }
  for (; done < width; done += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + done), _mm256_setzero_si256());
}

// O[16][D] (fp32) = P[16][32·pairs] · V for the packed V of one KV head ([pair block][chunk
// of 16 features] tiles), four feature chunks per pass over the probabilities.
// With a shared part, the pair blocks before it come from the shared tiles, in the same sum.
void block_values(ProductsFn products, const uint16_t* p, int64_t p_ld, const TileSource& vp, int64_t chunks,
                  int64_t pairs, float* o) {
  const int64_t shared_pairs = vp.shared_keys / kKeyPair;
  const uint32_t* first = shared_pairs ? vp.shared : vp.own;
  for (int64_t c0 = 0; c0 < chunks; c0 += 4)
    products(p, kKeyPair, p_ld * 2, first + c0 * 256, chunks * 256, 256, pairs, std::min<int64_t>(4, chunks - c0),
             o + c0 * 16, chunks * 16 * 4, vp.own + c0 * 256, shared_pairs ? shared_pairs : pairs);
}

}  // namespace

// q, out: [T, N_q, D] bf16 (out written only at the segments' rows); pools [num_blocks,
// block_size, N_kv, D] bf16, or int8 with their scales k_scale / v_scale [num_blocks,
// block_size, N_kv] fp32; slots: int64, every segment's context slots back to back;
// segments: int64 [n, 4] = (query_start, num_new, num_cached, slot_offset).
// shared: int64 [n, 2] = (leader, shared_len) per segment, or none: a member's first
// shared_len positions (a multiple of 64, within its cached history) are its leader's, whose
// packed tiles it reads instead of packing them again (the pool read once per group; the
// same products, so the same bits). A leader and a segment alone have (itself, 0).
void paged_prefill_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slots,
                             at::Tensor segments, double scale, at::Tensor out, c10::optional<at::Tensor> k_scale,
                             c10::optional<at::Tensor> v_scale, c10::optional<at::Tensor> shared) {
  check_prefill_args(q, k_pool, v_pool, slots, segments, scale, out, k_scale, v_scale);
  const bool int8 = k_pool.scalar_type() == at::kChar;
  const int64_t D = q.size(2), num_heads = q.size(1), num_kv = k_pool.size(2);
  q = q.contiguous();
  slots = slots.contiguous();
  segments = segments.contiguous();
  const int64_t n = segments.size(0), g = num_heads / num_kv;
  const int64_t* seg = segments.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t k_chunks = D / 32, v_chunks = D / 16;
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(seg[i * 4 + 3] + seg[i * 4 + 1] + seg[i * 4 + 2] <= slots.numel() && seg[i * 4] + seg[i * 4 + 1] <= q.size(0),
                "segment ", i, " out of range");
  // each segment's (leader, shared_len), checked: the shared slots must be the leader's
  std::vector<int64_t> leader_of(n), shared_len(n, 0);
  for (int64_t i = 0; i < n; ++i) leader_of[i] = i;
  if (shared) {
    TORCH_CHECK(shared->scalar_type() == at::kLong && shared->dim() == 2 && shared->size(0) == n && shared->size(1) == 2,
                "paged_prefill_attention: shared must be int64 [n, 2] (leader, shared_len)");
    const at::Tensor sh = shared->contiguous();
    const int64_t* sp = sh.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t lead = sp[i * 2], len = sp[i * 2 + 1];
      if (len == 0) continue;
      TORCH_CHECK(0 <= lead && lead < n && lead != i && sp[lead * 2 + 1] == 0 && len % 64 == 0 && len <= seg[i * 4 + 2] &&
                      len <= seg[lead * 4 + 1] + seg[lead * 4 + 2],
                  "paged_prefill_attention: segment ", i, " shares ", len, " positions of segment ", lead,
                  ": a leader sharing nothing itself, a multiple of 64 within both histories");
      TORCH_CHECK(std::equal(slot + seg[i * 4 + 3], slot + seg[i * 4 + 3] + len, slot + seg[lead * 4 + 3]),
                  "paged_prefill_attention: segment ", i, "'s first ", len, " slots are not segment ", lead, "'s");
      leader_of[i] = lead;
      shared_len[i] = len;
    }
  }

  // phase 1: pack K and V per (segment, KV head); a member only its positions after the shared part
  std::vector<PackedKV> packed(n * num_kv);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ctx = seg[i * 4 + 1] + seg[i * 4 + 2], own = ctx - shared_len[i];
    const int64_t k_size = (own + kKeyBlock - 1) / kKeyBlock * k_chunks * 256;
    const int64_t v_size = (own + kKeyPair - 1) / kKeyPair * v_chunks * 256;
    const int64_t scale_size = int8 ? 2 * ((ctx + kKeyPair - 1) / kKeyPair * kKeyPair) : 0;  // K's, then V's
    for (int64_t h = 0; h < num_kv; ++h) {
      packed[i * num_kv + h] = {total, total + k_size, total + k_size + v_size};
      total += k_size + v_size + scale_size;
    }
  }
  auto buffer = at::empty({std::max<int64_t>(total, 1)}, q.options().dtype(at::kInt));
  auto* buf = reinterpret_cast<uint32_t*>(buffer.data_ptr<int32_t>());
  at::parallel_for(0, n * num_kv, 1, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) {
      const int64_t i = u / num_kv, h = u % num_kv, ctx = seg[i * 4 + 1] + seg[i * 4 + 2];
      const int64_t* s = slot + seg[i * 4 + 3];
      const int64_t skip = shared_len[i];  // the leader packed these
      if (int8) {
        pack_keys_int8(k_pool.data_ptr<int8_t>(), num_kv * D, h, s + skip, ctx - skip, D, buf + packed[u].k_offset);
        pack_values_int8(v_pool.data_ptr<int8_t>(), num_kv * D, h, s + skip, ctx - skip, D, buf + packed[u].v_offset);
        // the keys' scales, zero past ctx (those keys' probabilities are zero anyway)
        const int64_t padded = (ctx + kKeyPair - 1) / kKeyPair * kKeyPair;
        float* ks = reinterpret_cast<float*>(buf + packed[u].scale_offset);
        float* vs = ks + padded;
        const float* k_sc = k_scale->data_ptr<float>();
        const float* v_sc = v_scale->data_ptr<float>();
        for (int64_t key = 0; key < padded; ++key) {
          ks[key] = key < ctx ? k_sc[s[key] * num_kv + h] : 0.f;
          vs[key] = key < ctx ? v_sc[s[key] * num_kv + h] : 0.f;
        }
      } else {
        pack_keys(reinterpret_cast<const uint32_t*>(k_pool.data_ptr<at::BFloat16>()), num_kv * D / 2, h, s + skip,
                  ctx - skip, D, buf + packed[u].k_offset);
        pack_values(reinterpret_cast<const uint16_t*>(v_pool.data_ptr<at::BFloat16>()), num_kv * D, h, s + skip,
                    ctx - skip, D, buf + packed[u].v_offset);
      }
    }
  });

  // phase 2: one unit per (segment, query head, block of 16 queries)
  std::vector<int64_t> unit_start(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) unit_start[i + 1] = unit_start[i] + num_heads * ((seg[i * 4 + 1] + kQueries - 1) / kQueries);
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t row_elems = num_heads * D;
  const float fscale = static_cast<float>(scale);
  const bool use_amx = amx_available();
  const ProductsFn products = use_amx ? four_products : vec_products;
  at::parallel_for(0, unit_start[n], 1, [&](int64_t b, int64_t e) {
    if (use_amx) configure_full_tiles(8);
    std::vector<float> s_buf, o_buf(kQueries * D);
    std::vector<uint16_t> p_buf, q_buf(kQueries * D);
    int64_t i = std::upper_bound(unit_start.begin(), unit_start.end(), b) - unit_start.begin() - 1;
    for (int64_t u = b; u < e; ++u) {
      while (u >= unit_start[i + 1]) ++i;
      const int64_t q0 = seg[i * 4], m = seg[i * 4 + 1], s0 = seg[i * 4 + 2];
      const int64_t blocks_q = (m + kQueries - 1) / kQueries, local = u - unit_start[i];
      const int64_t h = local / blocks_q, first = (local % blocks_q) * kQueries;
      const int64_t rows = std::min<int64_t>(kQueries, m - first);
      const int64_t seen = s0 + first + rows;  // keys the block's last query sees
      const int64_t width = (seen + kKeyPair - 1) / kKeyPair * kKeyPair;
      s_buf.resize(kQueries * width);
      p_buf.resize(kQueries * width);
      // Q rows of this head; a short last block is copied so the tile reads zeros past m
      const uint16_t* qa = qp + (q0 + first) * row_elems + h * D;
      int64_t q_stride = row_elems * 2;
      if (rows < kQueries) {
        std::memset(q_buf.data(), 0, q_buf.size() * 2);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(q_buf.data() + r * D, qa + r * row_elems, D * 2);
        qa = q_buf.data();
        q_stride = D * 2;
      }
      const PackedKV& kv = packed[i * num_kv + h / g];
      const PackedKV& lead = packed[leader_of[i] * num_kv + h / g];
      const TileSource k_tiles{buf + lead.k_offset, buf + kv.k_offset, shared_len[i]};
      const TileSource v_tiles{buf + lead.v_offset, buf + kv.v_offset, shared_len[i]};
      block_scores(products, qa, q_stride, k_tiles, k_chunks, (seen + kKeyBlock - 1) / kKeyBlock, s_buf.data(), width);
      for (int64_t r = 0; r < kQueries; ++r) {
        uint16_t* p = p_buf.data() + r * width;
        if (r >= rows) {
          std::memset(p, 0, width * 2);
        } else if (int8) {
          const float* ks = reinterpret_cast<const float*>(buf + kv.scale_offset);
          const int64_t padded = (s0 + m + kKeyPair - 1) / kKeyPair * kKeyPair;  // this segment's ctx, rounded
          softmax_row<true>(s_buf.data() + r * width, s0 + first + r + 1, width, fscale, p, ks, ks + padded);
        } else {
          softmax_row<false>(s_buf.data() + r * width, s0 + first + r + 1, width, fscale, p);
        }
      }
      block_values(products, p_buf.data(), width, v_tiles, v_chunks, width / kKeyPair, o_buf.data());
      for (int64_t r = 0; r < rows; ++r) {
        at::BFloat16* dst = op + (q0 + first + r) * row_elems + h * D;
        for (int64_t d = 0; d < D; d += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(o_buf.data() + r * D + d)));
      }
    }
    if (use_amx) _tile_release();
  });
}
