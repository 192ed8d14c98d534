// CPU kernels for the two memory-bound parts of decode, where PyTorch's generic paths
// read far below the machine's bandwidth:
//   gemv_bf16         y[M, N] = x[M, K] · w[N, K]ᵀ for small M (batch-1..8 decode), bf16
//                     weights streamed once with AVX512-BF16 dot products, fp32 accumulation.
//   paged_decode_attention
//                     one new query per request attending to its S0 + 1 cached positions,
//                     read in place from the block pool through the block table (no gather
//                     copy), g query heads of a KV head sharing each K/V row read.
// Batched projections on AMX tiles live in amx_linear.cpp, prompt-token attention on AMX
// tiles in prefill_attention.cpp (both bound here). The plain-torch path stays the
// reference these are tested against; kvserve/kernels/__init__.py falls back to it where
// they cannot be built.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "vec_math.h"

// Tests switch AMX attention off to check both paths of decode and prefill attention on
// one machine.
static bool amx_attention_enabled = true;
void set_amx_attention(bool enabled) { amx_attention_enabled = enabled; }
bool amx_attention_on() { return amx_attention_enabled && amx_available(); }


namespace {

// Softmax of n scores in place (fp32).
inline void softmax_inplace(float* sc, int64_t n) {
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

// ---- GEMV ---------------------------------------------------------------------------

constexpr int kRows = 4;  // weight rows per inner step: each x load feeds 4 dot products

template <int M>
void gemv_block(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t K, int64_t N,
                int64_t n_begin, int64_t n_end) {
  const int64_t k_vec = K / 32 * 32;
  for (int64_t n = n_begin; n < n_end; n += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, n_end - n));
    __m512 acc[M][kRows];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_vec; k += 32) {
      __m512bh wv[kRows];
      for (int r = 0; r < kRows; ++r) {
        const at::BFloat16* row = w + (n + (r < rows ? r : 0)) * K + k;
        _mm_prefetch(reinterpret_cast<const char*>(row + 8 * K), _MM_HINT_T0);
        wv[r] = (__m512bh)_mm512_loadu_si512(row);
      }
      for (int m = 0; m < M; ++m) {
        __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int r = 0; r < rows; ++r) {
        float sum = _mm512_reduce_add_ps(acc[m][r]);
        for (int64_t k = k_vec; k < K; ++k)
          sum += static_cast<float>(x[m * K + k]) * static_cast<float>(w[(n + r) * K + k]);
        y[m * N + n + r] = to_bf16(sum);
      }
    }
  }
}

template <int M>
void gemv_dispatch(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t K, int64_t N) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    gemv_block<M>(x, w, y, K, N, b0 * kRows, std::min(N, b1 * kRows));
  });
}

// y[M, N] = x[M, K] · wᵀ for small M on the VNNI-tile copy of w (amx_pack_weight's layout:
// per block of 16 output columns, K/32 tiles of 16 rows of pairs, one block contiguous),
// for CPUs without AMX. Each 64-byte tile row holds one pair of input features for all 16
// columns, so a broadcast pair of x times that row is one VDPBF16PS into the 16 columns'
// sums: the weights stream strictly in order and no horizontal sums are left. Row-major,
// gemv_block reads 4 rows 1,152 bytes apart (K = 576); on a Zen 4 it streamed the 30
// layers' projections at ~22 GB/s where this layout read ~39 (one row, from memory).
// C independent sums per row hide VDPBF16PS's latency when M alone cannot.
template <int M, int C>
void gemv_vnni_blocks(const at::BFloat16* x, const at::BFloat16* wp, at::BFloat16* y, int64_t K, int64_t N,
                      int64_t nb0, int64_t nb1) {
  const int64_t tiles = K / 32;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    __m512 acc[M][C];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
    const at::BFloat16* tile = wp + nb * tiles * 512;
    for (int64_t kb = 0; kb < tiles; ++kb, tile += 512) {
#pragma GCC unroll 4
      for (int kp = 0; kp < 16; kp += C) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(tile + (kp + c) * 32);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) {
            int32_t pair;  // (x[2kp], x[2kp + 1]) of this tile's 32 features, low half first like w's pairs
            std::memcpy(&pair, x + m * K + kb * 32 + 2 * (kp + c), sizeof(pair));
            acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)_mm512_set1_epi32(pair), wv);
          }
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      __m512 sum = acc[m][0];
      for (int c = 1; c < C; ++c) sum = _mm512_add_ps(sum, acc[m][c]);
      store16(y + m * N + nb * 16, sum);
    }
  }
}

template <int M>
void gemv_vnni_dispatch(const at::BFloat16* x, const at::BFloat16* wp, at::BFloat16* y, int64_t K, int64_t N) {
  constexpr int C = M == 1 ? 4 : M == 2 ? 2 : 1;
  at::parallel_for(0, N / 16, 4, [&](int64_t b0, int64_t b1) { gemv_vnni_blocks<M, C>(x, wp, y, K, N, b0, b1); });
}

// f(std::integral_constant<int, M>{}) for 1 <= M <= 8: the GEMVs' row count as a template
// argument, so their accumulators stay in registers.
template <typename F>
void with_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

}  // namespace

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16: bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_bf16: shapes");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 8, "gemv_bf16: 1 <= M <= 8");
  auto y = torch::empty({M, N}, x.options());
  auto* xp = x.data_ptr<at::BFloat16>();
  auto* wp = w.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  with_rows(M, [&](auto rows) { gemv_dispatch<decltype(rows)::value>(xp, wp, yp, K, N); });
  return y;
}

// x: [M <= 8, K] bf16; packed: amx_pack_weight(w) for w [N, K]. Returns [M, N] bf16.
torch::Tensor gemv_vnni(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "gemv_vnni: bf16 only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 32 && packed.is_contiguous(),
              "gemv_vnni: packed must come from amx_pack_weight");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(x.dim() == 2 && packed.size(1) * 32 == K, "gemv_vnni: x has ", K, " features, the weight ", packed.size(1) * 32);
  TORCH_CHECK(M >= 1 && M <= 8, "gemv_vnni: 1 <= M <= 8");
  auto y = torch::empty({M, N}, x.options());
  auto* xp = x.data_ptr<at::BFloat16>();
  auto* wp = packed.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  with_rows(M, [&](auto rows) { gemv_vnni_dispatch<decltype(rows)::value>(xp, wp, yp, K, N); });
  return y;
}

// ---- paged decode attention ---------------------------------------------------------------

namespace {

constexpr int64_t kMaxG = 16;

// Dot products of one query head (pre-loaded) with one K row, as 16 fp32 partial sums
// (fp32 pools; bf16 takes vec_scores or amx_scores).
struct QueryF32 {
  __m512 v[8];  // head_dim / 16 chunks
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
inline void accumulate_values(const float* const* v_rows, int64_t off, const float* scores, int64_t S, int64_t g,
                              int64_t hv, __m512 (*acc)[8]) {
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
                      int64_t pairs_end, int64_t gcount, __m512 (*acc)[8]) {
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
                              int64_t S, int64_t g, int64_t hv, __m512 (*acc)[8]) {
  const int64_t chunks = hv / 2;  // 32 bf16 per chunk
  const int64_t pairs_end = S / 2 * 2;
  // Heads in groups small enough for the accumulators to fit the 32 vector registers, of a
  // size that divides g where one does: a group's unused heads still cost their dpbf16s,
  // and VDPBF16PS issues only every other cycle here (half the MAC rate of fp32 FMAs).
  const int64_t most = chunks == 1 ? 8 : chunks == 2 ? 4 : 2;
  int64_t group = std::min(most, g);
  for (int64_t size = group; size >= 2; --size)
    if (g % size == 0) { group = size; break; }
  for (int64_t j0 = 0; j0 < g; j0 += group) {
    const int64_t n = std::min(group, g - j0);
    const uint16_t* p = pbf + j0 * S_pad;
    __m512 (*a)[8] = acc + j0;
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
                     int64_t ld_p, int64_t S, int64_t g, __m512 (*acc)[8]) {
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
                             float* inv_sum) {
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
    inv_sum[j] = 1.f / _mm512_reduce_add_ps(sum);
  }
  return pbf.data();
}

template <typename T>
void decode_attention_impl(const T* q, const T* k_pool, const T* v_pool, const int32_t* block_tables,
                           const int32_t* context_lens, T* out, int64_t B, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, bool use_amx) {
  const int64_t g = num_heads / num_kv_heads;
  TORCH_CHECK(g <= kMaxG, "at most 16 query heads per KV head");
  TORCH_CHECK((std::is_same_v<T, float>) || head_dim % 32 == 0, "bf16 decode attention: head_dim % 32 == 0");
  const int64_t slot_stride = num_kv_heads * head_dim;  // elements per pool slot
  const int64_t hv = head_dim / 16;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const T*> k_rows, v_rows, next_k_rows, next_v_rows;
    __m512 dots[16];
    alignas(64) uint16_t qb[4 * 512];  // the query heads' B tiles (AMX path)
    if (use_amx) configure_full_tiles(6);  // 0 = C, 1 = A, 2..5 = B
    // slot addresses of a request's positions, walking its block table (no division per position)
    auto slot_rows = [&](int64_t req, std::vector<const T*>& ks, std::vector<const T*>& vs) {
      const int64_t S = context_lens[req];
      const int32_t* table = block_tables + req * max_blocks;
      ks.resize(S);
      vs.resize(S);
      for (int64_t s = 0, blk = 0; s < S; ++blk) {
        const int64_t base = static_cast<int64_t>(table[blk]) * block_size * slot_stride;
        for (int64_t o = 0; o < block_size && s < S; ++o, ++s) {
          ks[s] = k_pool + base + o * slot_stride;
          vs[s] = v_pool + base + o * slot_stride;
        }
      }
    };
    if (begin < end) slot_rows(begin, next_k_rows, next_v_rows);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t S = context_lens[b];
      std::swap(k_rows, next_k_rows);
      std::swap(v_rows, next_v_rows);
      // the next request's rows are fetched while this one computes (more misses in flight)
      if (b + 1 < end) slot_rows(b + 1, next_k_rows, next_v_rows);
      else next_k_rows.clear(), next_v_rows.clear();
      const int64_t S_next = static_cast<int64_t>(next_k_rows.size());
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
        __m512 acc[kMaxG][8];
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
          const uint16_t* pbf = exp_to_bf16(scores.data(), S, g, row_max, ld_p, inv_sum);  // normalised on the output
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
            softmax_inplace(sc, S);
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

}  // namespace

// q: [B, N_q, H]; pools: [num_blocks, block_size, N_kv, H]; block_tables: [B, max_blocks] int32;
// context_lens: [B] int32 (S0 + 1, the new position's K/V already written). Returns [B, N_q, H].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4, "paged_decode_attention: shapes");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(), "dtypes");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt, "int32 tables");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim % 16 == 0 && head_dim <= 128, "head_dim must be a multiple of 16, at most 128");
  TORCH_CHECK(q.scalar_type() != at::kBFloat16 || head_dim % 32 == 0, "bf16: head_dim must be a multiple of 32");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), num_heads = q.size(1), num_kv_heads = k_pool.size(2), block_size = k_pool.size(1);
  if (q.scalar_type() == at::kBFloat16) {
    // AMX scores need whole 16-position blocks (a block's unused slots are read, never used)
    const bool use_amx = amx_attention_enabled && block_size % 16 == 0 && amx_available();
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

// ---- fused elementwise steps of a layer -----------------------------------------------------

// Calls f with a value of the element type (float or at::BFloat16) of `type`.
template <typename F>
void dispatch_f32_bf16(at::ScalarType type, const char* name, F&& f) {
  if (type == at::kFloat) {
    f(float{});
  } else if (type == at::kBFloat16) {
    f(at::BFloat16{});
  } else {
    TORCH_CHECK(false, name, ": float32 or bfloat16 only, got ", type);
  }
}
// Each replaces 5-10 small torch ops whose per-call overhead dominates at decode sizes.

namespace {

template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t D, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 v = load16(x + d);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / D + eps);
  const __m512 invb = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < D; d += 16) {
    // normalise in fp32, round to the model dtype, then scale (the reference's order)
    __m512 n = _mm512_mul_ps(load16(x + d), invb);
    if constexpr (std::is_same_v<T, at::BFloat16>) n = round_bf16(n);
    store16(out + d, _mm512_mul_ps(n, load16(w + d)));
  }
}

template <typename T>
void add_rows(T* residual, const T* x, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) store16(residual + d, _mm512_add_ps(load16(residual + d), load16(x + d)));
}

}  // namespace

// out = RMSNorm(x) · weight; with `residual`: residual += x first (in place) and the norm
// reads the updated residual, as the decoder layer's pre-norm residual stream does.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 16 == 0, "rms_norm: [T, D] contiguous, D % 16 == 0");
  const int64_t T_ = x.size(0), D = x.size(1);
  auto out = torch::empty_like(x);
  dispatch_f32_bf16(x.scalar_type(), "rms_norm", [&](auto tag) {
      using T = decltype(tag);
      T* res = residual ? residual->data_ptr<T>() : nullptr;
      at::parallel_for(0, T_, 64, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          const T* src = x.data_ptr<T>() + t * D;
          if (res) { add_rows(res + t * D, src, D); src = res + t * D; }
          rms_norm_row(src, weight.data_ptr<T>(), out.data_ptr<T>() + t * D, D, static_cast<float>(eps));
        }
      });
  });
  return out;
}

namespace {

template <typename T>
void rope_row(const T* src, T* dst, const float* cos, const float* sin, int64_t H) {
  // rotate-half: out[i] = x[i]·cos[i] − x[i+H/2]·sin[i]; out[i+H/2] = x[i+H/2]·cos[i] + x[i]·sin[i]
  const int64_t half = H / 2;
  for (int64_t i = 0; i < half; i += 16) {
    __m512 a = load16(src + i), b = load16(src + half + i);
    __m512 c = _mm512_loadu_ps(cos + i), s = _mm512_loadu_ps(sin + i);
    store16(dst + i, _mm512_fnmadd_ps(b, s, _mm512_mul_ps(a, c)));
    store16(dst + half + i, _mm512_fmadd_ps(a, s, _mm512_mul_ps(b, c)));
  }
}

template <typename T>
void copy_row(const T* src, T* dst, int64_t H) {
  for (int64_t i = 0; i < H; i += 16) store16(dst + i, load16(src + i));
}

}  // namespace

// qkv: [T, (N_q + 2 N_kv) · H] from the fused projection. Applies RoPE to Q and K (cos/sin
// tables [max_pos, H/2] fp32), writes K and V into their pool slots, returns Q [T, N_q, H].
torch::Tensor rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos_table, torch::Tensor sin_table,
                             torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slot_mapping,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(), "rope_and_cache: contiguous");
  TORCH_CHECK(head_dim % 32 == 0, "rope_and_cache: head_dim % 32 == 0");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong, "int64 positions/slots");
  const int64_t T_ = qkv.size(0), width = qkv.size(1), half = head_dim / 2;
  auto q = torch::empty({T_, num_heads, head_dim}, qkv.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* cos = cos_table.data_ptr<float>();
  const float* sin = sin_table.data_ptr<float>();
  dispatch_f32_bf16(qkv.scalar_type(), "rope_and_cache", [&](auto tag) {
      using T = decltype(tag);
      at::parallel_for(0, T_, 16, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          const T* row = qkv.data_ptr<T>() + t * width;
          const float* c = cos + pos[t] * half; const float* s_ = sin + pos[t] * half;
          for (int64_t h = 0; h < num_heads; ++h) rope_row(row + h * head_dim, q.data_ptr<T>() + (t * num_heads + h) * head_dim, c, s_, head_dim);
          T* kdst = k_pool.data_ptr<T>() + slots[t] * num_kv_heads * head_dim;
          T* vdst = v_pool.data_ptr<T>() + slots[t] * num_kv_heads * head_dim;
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            rope_row(row + (num_heads + h) * head_dim, kdst + h * head_dim, c, s_, head_dim);
            copy_row(row + (num_heads + num_kv_heads + h) * head_dim, vdst + h * head_dim, head_dim);
          }
        }
      });
  });
  return q;
}

// gate_up: [T, 2F] → silu(gate) · up: [T, F]
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(1) % 32 == 0, "silu_and_mul: [T, 2F] contiguous, F % 16 == 0");
  const int64_t T_ = gate_up.size(0), F_ = gate_up.size(1) / 2;
  auto out = torch::empty({T_, F_}, gate_up.options());
  dispatch_f32_bf16(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
      using T = decltype(tag);
      at::parallel_for(0, T_, 16, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          const T* g = gate_up.data_ptr<T>() + t * 2 * F_; T* o = out.data_ptr<T>() + t * F_;
          for (int64_t i = 0; i < F_; i += 16)
            // the reference rounds silu(gate) to the model dtype before the product
            store16(o + i, silu_mul16(load16(g + i), load16(g + F_ + i), std::is_same_v<T, at::BFloat16>));
        }
      });
  });
  return out;
}

// ---- greedy sampling ---------------------------------------------------------------------

namespace {

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  // per-lane running max and the first index reaching it; ties keep the lowest index
  const int64_t nv = n / 16 * 16;
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_idx = _mm512_setzero_si512();
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t i = 0; i < nv; i += 16) {
    __m512 v = load16(x + i);
    __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  alignas(64) float vals[16];
  alignas(64) int32_t ids[16];
  _mm512_store_ps(vals, best);
  _mm512_store_si512(ids, best_idx);
  float top = -INFINITY;
  int64_t arg = 0;
  for (int lane = 0; lane < 16; ++lane)
    if (vals[lane] > top || (vals[lane] == top && ids[lane] < arg)) { top = vals[lane]; arg = ids[lane]; }
  for (int64_t i = nv; i < n; ++i) {
    float v = static_cast<float>(x[i]);
    if (v > top) { top = v; arg = i; }
  }
  return arg;
}

}  // namespace

// Row-wise argmax of logits [R, V] (ties → lowest index, as torch.argmax).
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "argmax_rows: [R, V] contiguous");
  const int64_t R = x.size(0), V = x.size(1);
  auto out = torch::empty({R}, x.options().dtype(at::kLong));
  auto* o = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16) {
    const auto* p = x.data_ptr<at::BFloat16>();
    at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) { for (int64_t r = b; r < e; ++r) o[r] = argmax_row(p + r * V, V); });
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "argmax_rows: bf16 or fp32");
    const auto* p = x.data_ptr<float>();
    at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) { for (int64_t r = b; r < e; ++r) o[r] = argmax_row(p + r * V, V); });
  }
  return out;
}

// ---- a whole decode step's layers in one call ------------------------------------------------

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
torch::Tensor amx_linear_silu_mul(torch::Tensor x, torch::Tensor packed);
torch::Tensor amx_linear_argmax(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);

namespace {

// Which packed copies decode_layers gets in each layer's slots 7-10 (see below).
enum class Packed { kNone, kAmx, kOneDnn };

Packed parse_packed(const std::string& kind) {
  if (kind == "amx") return Packed::kAmx;
  if (kind == "onednn") return Packed::kOneDnn;
  TORCH_CHECK(kind == "none", "decode_layers: packed must be amx, onednn or none, got ", kind);
  return Packed::kNone;
}

// oneDNN's linear on a weight it packed (torch.ops.mkldnn._linear_pointwise), the call
// kvserve.model.linear.Linear makes from Python on CPUs without AMX. Boxed, so no C++
// signature of ours has to match the operator's registration.
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias.defined() && bias.numel() > 0 ? c10::IValue(bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x · wᵀ (+ bias, if not empty) for a decode batch, as kvserve.model.linear.Linear computes
// it: the GEMV kernel up to 8 rows (bias added to the bf16 result; on the VNNI copy where
// `w` is one, 4-D), beyond that the AMX kernel (bias added in fp32) or oneDNN on their
// packed copies.
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& packed, Packed kind,
                      const torch::Tensor& bias = torch::Tensor()) {
  const bool has_bias = bias.defined() && bias.numel() > 0;
  if (x.size(0) <= 8) {
    torch::Tensor y = w.dim() == 4 ? gemv_vnni(x, w) : gemv_bf16(x, w);
    return has_bias ? y.add_(bias) : y;
  }
  if (kind == Packed::kOneDnn) return onednn_linear(x, packed, bias);
  return amx_linear(x, packed, has_bias ? c10::optional<torch::Tensor>(bias) : c10::nullopt);
}

}  // namespace

// Every decoder layer for a batch of decode tokens (one new position per request, bf16):
// the same kernels the Python layer calls, in the same order, without returning to Python
// between them. At batch 1 the ~300 Python-level calls of a step cost as much as a third
// of the weight-streaming time; at batch 64 they are still ~5% of the step. This is the
// CPU's answer to what CUDA graphs do for launch overhead. `layers` holds, per layer:
// input norm, QKV weight, QKV bias (empty if none), O, post-attention norm, gate_up, down
// (the four weights row-major, or each as its VNNI copy for gemv_vnni), then the packed
// QKV, O, gate_up and down that `packed` names: "amx" (gate_up with its
// gate and up blocks interleaved, for amx_linear_silu_mul), "onednn" (oneDNN's layout), or
// "none" (empty tensors; only batches of <= 8 rows then).
// Returns the residual stream after the last layer (before the final norm).
torch::Tensor decode_layers(torch::Tensor h, std::vector<torch::Tensor> layers, std::vector<torch::Tensor> k_pools,
                            std::vector<torch::Tensor> v_pools, torch::Tensor positions, torch::Tensor cos_half,
                            torch::Tensor sin_half, torch::Tensor slot_mapping, torch::Tensor block_tables,
                            torch::Tensor context_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            double eps, double scale, const std::string& packed) {
  constexpr size_t kPerLayer = 11;
  TORCH_CHECK(layers.size() == k_pools.size() * kPerLayer && k_pools.size() == v_pools.size(), "decode_layers: weights");
  const int64_t B = h.size(0);
  const Packed kind = parse_packed(packed);
  TORCH_CHECK(B <= 8 || (kind != Packed::kNone && layers[7].numel() > 0),
              "decode_layers: more than 8 rows need packed weights");
  torch::Tensor residual;
  for (size_t l = 0; l < k_pools.size(); ++l) {
    const torch::Tensor* w = &layers[l * kPerLayer];
    torch::Tensor x = residual.defined() ? rms_norm(h, w[0], eps, residual) : rms_norm(h, w[0], eps, c10::nullopt);
    if (!residual.defined()) residual = h;
    torch::Tensor qkv = project(x, w[1], w[7], kind, w[2]);
    torch::Tensor q = rope_and_cache(qkv, positions, cos_half, sin_half, k_pools[l], v_pools[l], slot_mapping,
                                     num_heads, num_kv_heads, head_dim);
    torch::Tensor attn = paged_decode_attention(q, k_pools[l], v_pools[l], block_tables, context_lens, scale);
    torch::Tensor o = project(attn.view({B, num_heads * head_dim}), w[3], w[8], kind);
    x = rms_norm(o, w[4], eps, residual);
    torch::Tensor hidden = B > 8 && kind == Packed::kAmx ? amx_linear_silu_mul(x, w[9])
                                                         : silu_and_mul(project(x, w[5], w[9], kind));
    h = project(hidden, w[6], w[10], kind);
  }
  return residual.add_(h);
}

// amx_linear.cpp
torch::Tensor amx_pack_weight(torch::Tensor w);
// prefill_attention.cpp
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots,
                             torch::Tensor segments, double scale, torch::Tensor out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_available", &amx_available, "AMX-BF16 present and granted to this process");
  m.def("set_amx_attention", &set_amx_attention, "use AMX for decode and prefill attention where available (default on)");
  m.def("amx_pack_weight", &amx_pack_weight, "[N, K] bf16 weight -> AMX VNNI tiles");
  m.def("amx_linear_silu_mul", &amx_linear_silu_mul,
        "silu(x @ gate.T) * (x @ up.T) on AMX tiles, gate/up packed with their 16-column blocks interleaved");
  m.def("amx_linear", &amx_linear, "y = x @ w.T (+ bias) on AMX tiles", py::arg("x"), py::arg("packed"),
        py::arg("bias") = py::none());
  m.def("amx_linear_argmax", &amx_linear_argmax,
        "argmax over each row of x @ w.T (+ bias) rounded to bf16, without writing the product (at most 128 rows)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("decode_layers", &decode_layers, "all decoder layers of a small decode batch, in C++");
  m.def("argmax_rows", &argmax_rows, "row-wise argmax, ties to the lowest index");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after residual += x (in place)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("rope_and_cache", &rope_and_cache, "RoPE on Q and K, K/V written to their slots; returns Q");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("gemv_bf16", &gemv_bf16, "y = x @ w.T for small M, bf16");
  m.def("gemv_vnni", &gemv_vnni, "y = x @ w.T for small M, bf16, on amx_pack_weight(w)");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV pool",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"));
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of prompt tokens over the paged KV pool on AMX tiles, into out",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("slots"), py::arg("segments"), py::arg("scale"),
        py::arg("out"));
}
