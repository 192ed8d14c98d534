// The gemv family: y[M, N] = x[M, K] · w[N, K]ᵀ in bf16, fp32 sums,
// in 8-lane AVX2/FMA vectors (EVEX-encoded, with 32 vector registers, at avx512-vnni).
//
// On the VNNI tiles (gemm_tiles: gemv_vnni and gemm_vnni). Tile (nb, kb) is 16 rows of 64
// bytes; row kp holds, for each of the block's 16 output columns, the bf16 pair of inputs
// 2kp and 2kp + 1 in one 32-bit lane (the even input in the low half). One 256-bit load is
// 8 columns × one pair: shifted left by 16 it is the even input's weights as 8 fp32 lanes,
// masked with 0xffff0000 the odd input's; each multiplies a broadcast x[2kp] (x[2kp + 1]),
// all of x converted to fp32 once per call, into the 8 columns' own accumulators. So every
// output (row m, column n) is one fp32 accumulator updated by one FMA per input, k = 0, 1,
// ..., K - 1 in order, and rounded to bf16 (nearest even) at the end. That order is fixed:
// whatever the tile shape (rows of x × column blocks in registers, picked by M and by the
// level's register count), and wherever the depth is cut into chunks (the partial sums are
// parked in fp32 and resumed, which changes no bit), each output sees the same FMAs in the
// same order. A row's bits therefore never depend on M, on its place in the call or on the
// thread count: the VNNI copy serves every row count in one order (--deterministic).
//
//   1..kDirectRows rows (decode): one pass over the weight, each tile read once from memory
//     for all rows; with few rows, several column blocks are in flight at once (B) so that
//     at least 8 independent accumulators hide the FMA latency, taken from B lanes of the
//     thread's blocks so that each is one long stream (decode_blocks).
//   up to kSplitRows rows: the same tiles on groups of <= kDirectRows rows, the depth in
//     chunks of 8 KiB of weights per column block, which the first group reads from memory
//     and the others from L1 (partial sums parked between chunks).
//   more rows (as BLIS blocks a GEMM): chunks of kPanelRowChunk rows of x, converted to fp32 and
//     packed per group of <= kPanelRows rows as [k][rows of the group] (shared by the
//     threads); each thread's column blocks in runs of kMacroBlocks, the depth in chunks; per
//     chunk and group of kPanelBlocks column blocks, the weights are widened once into an
//     fp32 panel [k][columns] (kPanelBytes, in L1), which every row group then passes: per
//     input k, one broadcast x[m][k] and one FMA per 8 columns, the weights read as they
//     are (no widening per row). The partial sums wait in fp32 in a per-thread buffer
//     (rows × the run's columns, in L2) between depth chunks, so the x of a depth chunk
//     (rows × its inputs) stays in L2 while the run's column blocks pass over it. The same
//     FMA per (row, column, k), in the same k order, as the one-pass tiles.
// Threads take contiguous ranges of column blocks (each streams its part of the weight in
// the order it is stored); in the decode and panel paths a thread done with its range takes
// the back of another's (parallel.h).
//
// On the row-major weight (gemv_rowmajor: gemv_bf16). One 256-bit load is 16 consecutive
// inputs of one weight row; shifted/masked as above it is the even and the odd inputs of
// those 16, which multiply x stored per 16 inputs as [8 even, 8 odd] (x is rearranged so
// once per call). Lane j of a (row, column) accumulator sums inputs 16c + 2j, 16c + 2j + 1
// for c = 0, 1, ... in order; then the 8 lanes in hsum8's fixed order, then the K % 16 last
// inputs in order (scalar FMAs). The same for every tile shape, so a row's bits do not
// depend on M either.
#include "gemv.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "parallel.h"

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace gemv {
namespace {

constexpr int kVecRegs = simd::kVecRegs;

constexpr int64_t kTileElems = kTileN * kTileK;  // bf16 per tile (1 KiB)
constexpr int64_t kRowChunk = 72;                // rows of x (bf16) per pass of the pair tiles' many-row path
constexpr int64_t kPanelBytes = 16384;           // fp32 panel of widened weights per depth chunk (L1)
constexpr int64_t kSplitChunkBytes = 8192;      // weights per depth chunk of the few-row path (L1)
// up to this many rows, the few-row path (split_range); past it, the panels. Measured on a
// Zen 4 core at both levels: the few-row path 10-25% faster up to 24 rows, the panels from 32
// (widening a panel is a pass of its own that the few rows cannot amortize).
constexpr int64_t kSplitRows = 24;
constexpr int64_t kPanelRowChunk = 144;          // rows of x per pass of the panel path: each pass widens every panel
constexpr int64_t kMacroBlocks = 16;             // column blocks per run (its partial sums: 144 × 256 fp32)
// below this many multiply-adds a call runs on the calling thread (a fork costs microseconds)
constexpr int64_t kParallelMacs = int64_t(1) << 18;

// the VNNI shapes: rows of x and column blocks per register tile
constexpr int kDirectRows = kVecRegs >= 32 ? 8 : 4;  // decode rows served in one pass
constexpr int kPanelRows = 6;                          // rows per tile of the many-row path
constexpr int kPanelBlocks = kVecRegs >= 32 ? 2 : 1;   // column blocks per panel: 6×16 (6×32) accumulators

// column blocks in flight for a one-pass GEMV of `rows` rows: >= 8 accumulators where the
// registers allow
constexpr int direct_blocks(int rows) {
  if (kVecRegs >= 32) return rows <= 2 ? 4 : rows <= 4 ? 2 : 1;
  return rows == 1 ? 4 : rows == 2 ? 2 : 1;
}

inline float* scratch(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// rows [m0, m1) of x (bf16, row stride K) into xf (fp32, row stride K), as they are
inline void widen_rows(const uint16_t* x, float* xf, int64_t K, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* src = x + m * K;
    float* dst = xf + m * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) simd::store8(dst + k, simd::load8(src + k));
    for (; k < K; ++k) dst[k] = simd::bf16_to_f32(src[k]);
  }
}

// this thread's share [b, e) of n items: contiguous, in thread order
inline void thread_range(int64_t n, int64_t& b, int64_t& e) {
  const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
  b = n * t / T;
  e = n * (t + 1) / T;
}

// the block group at nb: as many of `blocks` as are left before nb1 (4, then 2, then 1)
inline int group_blocks(int blocks, int64_t nb, int64_t nb1) {
  while (blocks > 1 && nb + blocks > nb1) blocks /= 2;
  return blocks;
}

// Decode-sized calls (one pass over the weight, bound by its stream). A decode tile reads B
// column blocks at once (B = the tile's blocks in flight), each block a stream of its own. Were
// they B neighbouring blocks, every stream would end after one block (K·32 bytes: 18 KiB for
// K = 576) and the next tile's B would start cold: the hardware prefetcher retrains at each, and
// over a decode step's ~120 small projections that cost a core a fifth of its stream (one
// thread, the default model's shapes, Zen 4 at avx2: 18.5-20.2 GB/s against 23.4-25.9 for
// 4096 × 4096 matrices). So each thread's share of the blocks is cut into B lanes, and step i
// of its tiles takes block i of each lane: B streams that run the whole lane, block after
// adjacent block (the same shapes, one thread: 21.4-22.3 GB/s; two threads, where the host's
// bandwidth allows more than the cores pull: 29.1-31.3 -> 41.2 GB/s; a decode step of the bf16
// default model, time before / after over 8 alternating pairs: 0.93-1.25, median 1.05). Steps
// are handed out by stealing (parallel.h), as quant_linear does, so a core the host slows does
// not hold the other at each projection's end (a thief takes the back steps of the victim's
// lanes); the blocks left over past whole lanes (fewer than B a thread) follow,
// in adjacent groups, stolen the same way. A block's values never depend on the tile, lane,
// thread or chunk that computes it.
//   tile(nb, stride, count): `count` blocks nb, nb + stride, ..., of one tile
template <typename Tile>
void decode_blocks(int64_t NB, int B, bool parallel, const Tile& tile) {
  const int threads = parallel ? omp_get_max_threads() : 1;
  const int64_t L = B > 1 ? NB / (int64_t(B) * threads) : 0;  // steps per lane
  const int64_t in_lanes = L * B * threads;
  StealingRange steps(L * threads, threads, std::max<int64_t>(1, L / 16));
  StealingRange rest(NB - in_lanes, threads, std::max<int64_t>(4, (NB - in_lanes) / (16 * threads) / 4 * 4));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int t = omp_get_thread_num();
    int64_t b, e;
    while (steps.next(t, b, e))
      for (int64_t s = b; s < e; ++s) tile((s / L) * B * L + s % L, L, B);
    while (rest.next(t, b, e))
      for (int64_t nb = in_lanes + b; nb < in_lanes + e;) {
        const int g = group_blocks(B, nb, in_lanes + e);
        tile(nb, 1, g);
        nb += g;
      }
  }
}

// 8 columns × one input pair of a tile row (16 bf16)
inline __m256i load_pair_row(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256 even_half(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 odd_half(__m256i v, __m256i hi) { return _mm256_castsi256_ps(_mm256_and_si256(v, hi)); }

// ---- VNNI tiles -----------------------------------------------------------------------------

// The register tiles (vnni_tile, panel_tile, rowmajor_tile) are kept out of line (noinline):
// inlined into their callers' loops, GCC once spilled one of the 12 accumulators of the 6-row
// panel tile to the stack, a store and reload in every input's chain that halved its speed.

// R rows of x (fp32, row stride K, from input 0) against B column blocks (w: the first
// block's tiles, block stride bs elements), depth tiles [kb0, kb1). The accumulators start
// from zero, or with `resume` from acc ([R][16B] fp32); they end in y (bf16, row stride N, at
// the group's first column) when y is given, else in acc. Per accumulator: for each tile, for
// each pair, FMA of the even input then of the odd one.
template <int R, int B>
__attribute__((noinline)) void vnni_tile(const float* x, int64_t K, const uint16_t* w, int64_t bs, int64_t kb0,
                                         int64_t kb1, float* acc, bool resume, uint16_t* y, int64_t N, int64_t ys) {
  constexpr int U = 2 * B;  // 8-column vectors per row
  // broadcasts held for the whole pair when they fit beside the accumulators; otherwise the
  // pair's widened weights are held and x is broadcast row by row (the same FMAs either way)
  constexpr bool pair_outer = 2 * R * B + 2 * R + 3 <= kVecRegs;
  __m256 a[R][U];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) a[r][u] = resume && acc ? simd::load8(acc + r * 16 * B + u * 8) : _mm256_setzero_ps();
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const uint16_t* t = w + kb * kTileElems;
    const float* xk = x + kb * kTileK;
#pragma GCC unroll 2
    for (int kp = 0; kp < 16; ++kp) {
      if constexpr (pair_outer) {
        __m256 xe[R], xo[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          xe[r] = _mm256_broadcast_ss(xk + r * K + 2 * kp);
          xo[r] = _mm256_broadcast_ss(xk + r * K + 2 * kp + 1);
        }
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) {
          const __m256i v = load_pair_row(t + (u / 2) * bs + kp * 32 + (u % 2) * 16);
          const __m256 e = even_half(v), o = odd_half(v, hi);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) a[r][u] = _mm256_fmadd_ps(e, xe[r], a[r][u]);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) a[r][u] = _mm256_fmadd_ps(o, xo[r], a[r][u]);
        }
      } else {
        __m256 e[U], o[U];
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) {
          const __m256i v = load_pair_row(t + (u / 2) * bs + kp * 32 + (u % 2) * 16);
          e[u] = even_half(v);
          o[u] = odd_half(v, hi);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256 xe = _mm256_broadcast_ss(xk + r * K + 2 * kp);
          const __m256 xo = _mm256_broadcast_ss(xk + r * K + 2 * kp + 1);
#pragma GCC unroll 8
          for (int u = 0; u < U; ++u) a[r][u] = _mm256_fmadd_ps(e[u], xe, a[r][u]);
#pragma GCC unroll 8
          for (int u = 0; u < U; ++u) a[r][u] = _mm256_fmadd_ps(o[u], xo, a[r][u]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      if (y) simd::store8(y + r * N + (u / 2) * ys + (u % 2) * 8, a[r][u]);
      else if (acc) simd::store8(acc + r * 16 * B + u * 8, a[r][u]);
    }
}

// only the shapes direct_tile and split_range use are compiled: B up to direct_blocks(R)
template <int R, int B>
void vnni_shape(const float* x, int64_t K, const uint16_t* w, int64_t bs, int64_t kb0, int64_t kb1, float* acc,
                bool resume, uint16_t* y, int64_t N, int64_t ys) {
  if constexpr (B <= direct_blocks(R)) vnni_tile<R, B>(x, K, w, bs, kb0, kb1, acc, resume, y, N, ys);
}

template <int B>
void vnni_rows(int rows, const float* x, int64_t K, const uint16_t* w, int64_t bs, int64_t kb0, int64_t kb1,
               float* acc, bool resume, uint16_t* y, int64_t N, int64_t ys) {
  switch (rows) {
    case 1: vnni_shape<1, B>(x, K, w, bs, kb0, kb1, acc, resume, y, N, ys); break;
    case 2: vnni_shape<2, B>(x, K, w, bs, kb0, kb1, acc, resume, y, N, ys); break;
    case 3: vnni_shape<3, B>(x, K, w, bs, kb0, kb1, acc, resume, y, N, ys); break;
    case 4: vnni_shape<4, B>(x, K, w, bs, kb0, kb1, acc, resume, y, N, ys); break;
#if defined(__AVX512VL__)
    case 5: vnni_shape<5, B>(x, K, w, bs, kb0, kb1, acc, resume, y, N, ys); break;
    case 6: vnni_shape<6, B>(x, K, w, bs, kb0, kb1, acc, resume, y, N, ys); break;
    case 7: vnni_shape<7, B>(x, K, w, bs, kb0, kb1, acc, resume, y, N, ys); break;
    case 8: vnni_shape<8, B>(x, K, w, bs, kb0, kb1, acc, resume, y, N, ys); break;
#endif
    default: break;  // never: rows <= kDirectRows
  }
}

// one tile of `rows` rows × `blocks` (1, 2 or 4) column blocks, bs elements (of w) and ys
// columns (of y) apart
inline void vnni_call(int rows, int blocks, const float* x, int64_t K, const uint16_t* w, int64_t bs, int64_t kb0,
                      int64_t kb1, float* acc, bool resume, uint16_t* y, int64_t N, int64_t ys = kTileN) {
  switch (blocks) {
    case 4: vnni_rows<4>(rows, x, K, w, bs, kb0, kb1, acc, resume, y, N, ys); break;
    case 2: vnni_rows<2>(rows, x, K, w, bs, kb0, kb1, acc, resume, y, N, ys); break;
    default: vnni_rows<1>(rows, x, K, w, bs, kb0, kb1, acc, resume, y, N, ys); break;
  }
}

// rows <= kDirectRows of xf against `count` column blocks nb, nb + stride, ... (one tile, every
// weight tile read once)
void direct_tile(const float* xf, int rows, const uint16_t* wp, uint16_t* y, int64_t K, int64_t N, int64_t nb,
                 int64_t stride, int count) {
  const int64_t KB = K / kTileK, bs = KB * kTileElems;
  vnni_call(rows, count, xf, K, wp + nb * bs, stride * bs, 0, KB, nullptr, false, y + nb * kTileN, N, stride * kTileN);
}

// more than kDirectRows rows (up to kSplitRows) of xf against column blocks [nb0, nb1): row
// groups of <= kDirectRows, balanced; per column block, the depth in chunks of
// kSplitChunkBytes of weights, which the first group reads from memory and the others from
// L1 (the partial sums wait in acc, rows × 16 fp32)
void split_range(const float* xf, int64_t rows, const uint16_t* wp, uint16_t* y, int64_t K, int64_t N, int64_t nb0,
                 int64_t nb1, float* acc) {
  const int64_t KB = K / kTileK, bs = KB * kTileElems;
  const int64_t count = (rows + kDirectRows - 1) / kDirectRows;
  const int64_t kc = std::max<int64_t>(1, kSplitChunkBytes / (kTileElems * 2));
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    for (int64_t kb0 = 0;; kb0 += kc) {
      const int64_t kb1 = std::min(KB, kb0 + kc);
      const bool last = kb1 == KB;
      for (int64_t g = 0; g < count; ++g) {
        const int64_t m0 = g * (rows / count) + std::min(g, rows % count);
        const int r = static_cast<int>(rows / count + (g < rows % count ? 1 : 0));
        vnni_call(r, 1, xf + m0 * K, K, wp + nb * bs, bs, kb0, kb1, acc + m0 * kTileN, kb0 > 0,
                  last ? y + m0 * N + nb * kTileN : nullptr, N);
      }
      if (last) break;
    }
  }
}

// Tiles [kb0, kb1) of the B column blocks at w (block stride bs) widened into panel: fp32
// [(kb1 - kb0)·32 inputs][16·B columns], exactly the weights (bf16 → fp32 changes no bit).
template <int B>
void widen_panel(const uint16_t* w, int64_t bs, int64_t kb0, int64_t kb1, float* panel) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    float* row = panel + (kb - kb0) * kTileK * 16 * B;
    for (int kp = 0; kp < 16; ++kp, row += 2 * 16 * B)
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i v = load_pair_row(w + b * bs + kb * kTileElems + kp * 32 + h * 16);
          simd::store8(row + b * 16 + h * 8, even_half(v));            // input 2kp
          simd::store8(row + 16 * B + b * 16 + h * 8, odd_half(v, hi));  // input 2kp + 1
        }
  }
}

// R rows of x (packed: input k of row r at x[k·R + r], from the panel's first input) × the
// panel's 16·B columns over its nk inputs: per input, for each row, one FMA per 8 columns.
// Accumulators from zero or (resume) from acc (row stride ld fp32); they end in y (bf16,
// row stride N) if given, else in acc.
template <int R, int B>
__attribute__((noinline)) void panel_tile(const float* x, const float* panel, int64_t nk, float* acc, int64_t ld,
                                          bool resume, uint16_t* y, int64_t N) {
  constexpr int U = 2 * B;
  __m256 a[R][U];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) a[r][u] = resume ? simd::load8(acc + r * ld + u * 8) : _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int64_t k = 0; k < nk; ++k) {
    const float* wk = panel + k * 16 * B;
    __m256 wv[U];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) wv[u] = simd::load8(wk + u * 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + k * R + r);
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) a[r][u] = _mm256_fmadd_ps(wv[u], xb, a[r][u]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      if (y) simd::store8(y + r * N + u * 8, a[r][u]);
      else simd::store8(acc + r * ld + u * 8, a[r][u]);
    }
}

template <int B>
void panel_rows(int rows, const float* x, const float* panel, int64_t nk, float* acc, int64_t ld, bool resume,
                uint16_t* y, int64_t N) {
  static_assert(kPanelRows == 6, "panel_rows instantiates 1..6 rows");
  switch (rows) {
    case 1: panel_tile<1, B>(x, panel, nk, acc, ld, resume, y, N); break;
    case 2: panel_tile<2, B>(x, panel, nk, acc, ld, resume, y, N); break;
    case 3: panel_tile<3, B>(x, panel, nk, acc, ld, resume, y, N); break;
    case 4: panel_tile<4, B>(x, panel, nk, acc, ld, resume, y, N); break;
    case 5: panel_tile<5, B>(x, panel, nk, acc, ld, resume, y, N); break;
    default: panel_tile<6, B>(x, panel, nk, acc, ld, resume, y, N); break;
  }
}

// `rows` rows split into the fewest groups of <= kPanelRows, sizes within one of each other
// (26 rows: 6 + 5 + 5 + 5 + 5, not 4 × 6 + 2: a tile of 2 rows × 16 columns has too few
// accumulators in flight to hide the FMA latency)
struct RowGroups {
  int64_t rows, count;
  explicit RowGroups(int64_t n) : rows(n), count((n + kPanelRows - 1) / kPanelRows) {}
  int64_t start(int64_t g) const { return g * (rows / count) + std::min(g, rows % count); }
  int size(int64_t g) const { return static_cast<int>(rows / count + (g < rows % count ? 1 : 0)); }
};

// rows of group g of x (bf16, row stride K) into xp at the group's start row · K: fp32,
// input-major within the group ([k][rows of the group])
void pack_group(const uint16_t* x, float* xp, int64_t K, const RowGroups& groups, int64_t g) {
  const int64_t m0 = groups.start(g);
  const int R = groups.size(g);
  float* dst = xp + m0 * K;
  for (int r = 0; r < R; ++r) {
    const uint16_t* src = x + (m0 + r) * K;
    for (int64_t k = 0; k < K; ++k) dst[k * R + r] = simd::bf16_to_f32(src[k]);
  }
}

// rows of packed x (xp, groups) against column blocks [nb0, nb1) (one run or more of up to
// kMacroBlocks); y at the chunk's first row; acc: rows × 16·min(kMacroBlocks, nb1 - nb0) fp32,
// panel: kPanelBytes
void panel_range(const float* xp, const RowGroups& groups, const uint16_t* wp, uint16_t* y, int64_t K, int64_t N,
                 int64_t nb0, int64_t nb1, float* acc, float* panel) {
  const int64_t KB = K / kTileK, bs = KB * kTileElems;
  const int64_t kc = std::max<int64_t>(1, kPanelBytes / (kPanelBlocks * kTileElems * 4));  // tiles per depth chunk
  for (int64_t mb = nb0; mb < nb1; mb += kMacroBlocks) {
    const int64_t me = std::min(nb1, mb + kMacroBlocks), ld = (me - mb) * kTileN;
    for (int64_t kb0 = 0;; kb0 += kc) {
      const int64_t kb1 = std::min(KB, kb0 + kc), nk = (kb1 - kb0) * kTileK;
      const bool resume = kb0 > 0, last = kb1 == KB;
      for (int64_t nb = mb; nb < me;) {
        const int b = group_blocks(kPanelBlocks, nb, me);
        // The run's blocks are as many streams as the hardware prefetcher follows, each read a
        // depth chunk at a time: ask for these blocks' next chunk (the next pass over the run)
        // into L2 now, while the row groups compute on this one.
        for (int i = 0; i < b && kb1 < KB; ++i) {
          const char* next = reinterpret_cast<const char*>(wp + (nb + i) * bs + kb1 * kTileElems);
          const int64_t bytes = (std::min(KB, kb1 + kc) - kb1) * kTileElems * 2;
          for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
        }
        if (b == 2) widen_panel<2>(wp + nb * bs, bs, kb0, kb1, panel);
        else widen_panel<1>(wp + nb * bs, bs, kb0, kb1, panel);
        for (int64_t g = 0; g < groups.count; ++g) {
          const int64_t m0 = groups.start(g);
          const int R = groups.size(g);
          const float* xg = xp + m0 * K + kb0 * kTileK * R;
          float* ag = acc + m0 * ld + (nb - mb) * kTileN;
          uint16_t* yg = last ? y + m0 * N + nb * kTileN : nullptr;
          if (b == 2) panel_rows<2>(R, xg, panel, nk, ag, ld, resume, yg, N);
          else panel_rows<1>(R, xg, panel, nk, ag, ld, resume, yg, N);
        }
        nb += b;
      }
      if (last) break;
    }
  }
}

// ---- VNNI tiles by bf16 pair dots (kBf16Dot: avx512-bf16 and up) ----------------------------

// Here one VDPBF16PS takes a 32-byte tile row (8 columns × the pair of inputs 2kp, 2kp + 1)
// and a broadcast pair of x as they are stored, so neither side is widened and there is no
// panel: every row count runs the same register tile over x and the tiles in place. Each
// output is one fp32 accumulator, one VDPBF16PS per pair, tiles and pairs in order, whatever
// the tile's shape, its place in the call or the thread: a row's bits never depend on M.

// R rows of x (bf16, row stride K) × U 8-column vectors (column block u / 2, half u % 2; w:
// the first block's tiles, block stride bs) over every depth tile, into y (row stride N, at
// the first block's first column, the blocks ys columns apart)
template <int R, int U>
__attribute__((noinline)) void pair_tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t bs, uint16_t* y,
                                         int64_t N, int64_t ys) {
  __m256 a[R][U];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) a[r][u] = _mm256_setzero_ps();
  const int64_t KB = K / kTileK;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint16_t* t = w + kb * kTileElems;
    const uint16_t* xk = x + kb * kTileK;
#pragma GCC unroll 2
    for (int kp = 0; kp < 16; ++kp) {
      __m256i wv[U];
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) wv[u] = simd::load16_bf16(t + (u / 2) * bs + kp * 32 + (u % 2) * 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i xp = simd::bcast_pair(xk + r * K + 2 * kp);
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) a[r][u] = simd::dot2_bf16(a[r][u], xp, wv[u]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) simd::store8(y + r * N + (u / 2) * ys + (u % 2) * 8, a[r][u]);
}

// vectors per tile for R rows: enough sums in flight to hide VDPBF16PS's latency where the
// rows are few, within the registers (R·U accumulators + U weights + a broadcast)
constexpr int pair_vectors(int rows) { return rows <= 2 ? 8 : rows <= 4 ? 4 : rows <= 6 ? 4 : 2; }
constexpr int kPairRows = 6;  // rows per tile past the decode sizes: 6 × 32 columns

template <int U>
void pair_rows(int rows, const uint16_t* x, int64_t K, const uint16_t* w, int64_t bs, uint16_t* y, int64_t N,
               int64_t ys) {
  switch (rows) {
    case 1: if constexpr (U <= pair_vectors(1)) pair_tile<1, U>(x, K, w, bs, y, N, ys); break;
    case 2: if constexpr (U <= pair_vectors(2)) pair_tile<2, U>(x, K, w, bs, y, N, ys); break;
    case 3: if constexpr (U <= pair_vectors(3)) pair_tile<3, U>(x, K, w, bs, y, N, ys); break;
    case 4: if constexpr (U <= pair_vectors(4)) pair_tile<4, U>(x, K, w, bs, y, N, ys); break;
    case 5: if constexpr (U <= pair_vectors(5)) pair_tile<5, U>(x, K, w, bs, y, N, ys); break;
    case 6: if constexpr (U <= pair_vectors(6)) pair_tile<6, U>(x, K, w, bs, y, N, ys); break;
    case 7: if constexpr (U <= pair_vectors(7)) pair_tile<7, U>(x, K, w, bs, y, N, ys); break;
    case 8: if constexpr (U <= pair_vectors(8)) pair_tile<8, U>(x, K, w, bs, y, N, ys); break;
    default: break;  // never: rows <= 8
  }
}

// `rows` (1..8) rows against `count` (1, 2 or 4) column blocks nb, nb + stride, ... (one tile)
void pair_blocks(const uint16_t* x, int rows, const uint16_t* wp, uint16_t* y, int64_t K, int64_t N, int64_t nb,
                 int64_t stride, int count) {
  const int64_t bs = (K / kTileK) * kTileElems;
  const uint16_t* w = wp + nb * bs;
  uint16_t* yb = y + nb * kTileN;
  switch (count) {
    case 4: pair_rows<8>(rows, x, K, w, stride * bs, yb, N, stride * kTileN); break;
    case 2: pair_rows<4>(rows, x, K, w, stride * bs, yb, N, stride * kTileN); break;
    default: pair_rows<2>(rows, x, K, w, stride * bs, yb, N, stride * kTileN); break;
  }
}

// `rows` (1..8) rows against column blocks [nb0, nb1), up to pair_vectors(rows) / 2 neighbouring
// blocks a tile
void pair_range(const uint16_t* x, int rows, const uint16_t* wp, uint16_t* y, int64_t K, int64_t N, int64_t nb0,
                int64_t nb1) {
  for (int64_t nb = nb0; nb < nb1;) {
    const int b = group_blocks(pair_vectors(rows) / 2, nb, nb1);
    pair_blocks(x, rows, wp, y, K, N, nb, 1, b);
    nb += b;
  }
}

// M rows: up to kPairRows in one pass over the weight; more (7 and 8 as two tiles of 4 rows × 32
// columns, faster than one of 8 × 16) in chunks of kRowChunk rows
// whose x stays in L2, each thread's column blocks taken a pair at a time against every row
// group of the chunk (the pair's tiles then come from L2 for all but the first group)
void pair_gemm(const uint16_t* x, const uint16_t* wp, uint16_t* y, int64_t M, int64_t K, int64_t N, bool parallel) {
  const int64_t NB = N / kTileN;
  if (M <= kPairRows) {
    const int rows = static_cast<int>(M);
    decode_blocks(NB, pair_vectors(rows) / 2, parallel, [&](int64_t nb, int64_t stride, int count) {
      pair_blocks(x, rows, wp, y, K, N, nb, stride, count);
    });
    return;
  }
#pragma omp parallel if (parallel)
  {
    int64_t nb0, nb1;
    thread_range(NB, nb0, nb1);
    for (int64_t r0 = 0; r0 < M; r0 += kRowChunk) {
      const int64_t rows = std::min(kRowChunk, M - r0);
      const int64_t count = (rows + kPairRows - 1) / kPairRows;
      for (int64_t nb = nb0; nb < nb1; nb += 2) {
        const int64_t e = std::min(nb1, nb + 2);
        for (int64_t g = 0; g < count; ++g) {
          const int64_t m0 = r0 + g * (rows / count) + std::min(g, rows % count);
          const int r = static_cast<int>(rows / count + (g < rows % count ? 1 : 0));
          pair_range(x + m0 * K, r, wp, y + m0 * N, K, N, nb, e);
        }
      }
    }
  }
}

}  // namespace

void gemm_tiles(const uint16_t* x, const uint16_t* wp, uint16_t* y, int64_t M, int64_t K, int64_t N, bool pair_dots) {
  const int64_t NB = N / kTileN;
  if (M <= 0 || NB <= 0) return;
  const bool parallel = M * N * K >= kParallelMacs && omp_get_max_threads() > 1;
  if constexpr (simd::kBf16Dot)
    if (pair_dots) return pair_gemm(x, wp, y, M, K, N, parallel);
  static thread_local std::vector<float> xbuf;
  if (M <= kDirectRows) {
    float* xf = scratch(xbuf, static_cast<size_t>(M * K));
    widen_rows(x, xf, K, 0, M);
    decode_blocks(NB, direct_blocks(static_cast<int>(M)), parallel, [&](int64_t nb, int64_t stride, int count) {
      direct_tile(xf, static_cast<int>(M), wp, y, K, N, nb, stride, count);
    });
    return;
  }
  if (M <= kSplitRows) {
    float* xf = scratch(xbuf, static_cast<size_t>(M * K));
    widen_rows(x, xf, K, 0, M);
#pragma omp parallel if (parallel)
    {
      int64_t nb0, nb1;
      thread_range(NB, nb0, nb1);
      std::vector<float> acc(static_cast<size_t>(M * kTileN));
      split_range(xf, M, wp, y, K, N, nb0, nb1, acc.data());
    }
    return;
  }
  const int64_t chunk = std::min(M, kPanelRowChunk);
  float* xp = scratch(xbuf, static_cast<size_t>(chunk * K));
  // Per row chunk, each thread's run of column blocks is taken a run of up to kMacroBlocks at a
  // time from its front, and a thread done with its own takes runs from the back of the other's
  // (parallel.h): with a static split, the faster core waited at each chunk's barrier for the
  // slower (a 512-token prefill of the bf16 default model at avx2 on Zen 4: 10% of both
  // threads' samples in libgomp's team barrier; stolen: 3%, and such prefills, alternated in
  // one process, 783 -> 717 ms and 736 -> 725 ms in two sittings). Runs smaller than
  // kMacroBlocks where the blocks are few, so that a thief has something to take.
  const int threads = parallel ? omp_get_max_threads() : 1;
  const int64_t run = std::clamp<int64_t>(NB / (4 * threads), 1, kMacroBlocks);
  std::vector<std::unique_ptr<StealingRange>> runs;
  for (int64_t r0 = 0; r0 < M; r0 += chunk) runs.emplace_back(new StealingRange(NB, threads, run));
#pragma omp parallel num_threads(threads) if (parallel)
  {
    const int t = omp_get_thread_num();
    std::vector<float> acc(static_cast<size_t>(chunk * kTileN * run));
    alignas(64) float panel[kPanelBytes / sizeof(float)];
    for (int64_t r0 = 0, c = 0; r0 < M; r0 += chunk, ++c) {
      const RowGroups groups(std::min(chunk, M - r0));
#pragma omp for schedule(static)
      for (int64_t g = 0; g < groups.count; ++g) pack_group(x + r0 * K, xp, K, groups, g);
      // (the loop's barrier: every row packed before any thread reads them)
      int64_t nb0, nb1;
      while (runs[c]->next(t, nb0, nb1)) panel_range(xp, groups, wp, y + r0 * N, K, N, nb0, nb1, acc.data(), panel);
#pragma omp barrier
    }
  }
}

// ---- row-major ------------------------------------------------------------------------------

namespace {

constexpr int kRowMajorRows = kVecRegs >= 32 ? 8 : 4;  // rows of x per register tile

// weight rows per register tile for `rows` rows of x: RX·NR accumulators (8, 16 with 32 registers)
constexpr int rowmajor_columns(int rows) {
  if (kVecRegs >= 32) return rows <= 2 ? 8 : rows <= 4 ? 4 : 2;
  return rows == 1 ? 8 : rows == 2 ? 4 : 2;
}

// x rows (bf16, stride K) into xs (fp32, stride K) with each run of 16 inputs as [the 8
// even ones, the 8 odd ones]; the K % 16 last inputs as they are
inline void split_rows(const uint16_t* x, float* xs, int64_t M, int64_t K) {
  const int64_t K16 = K / 16 * 16;
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* src = x + m * K;
    float* dst = xs + m * K;
    for (int64_t k = 0; k < K16; k += 16) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
      simd::store8(dst + k, even_half(v));
      simd::store8(dst + k + 8, odd_half(v, hi));
    }
    for (int64_t k = K16; k < K; ++k) dst[k] = simd::bf16_to_f32(src[k]);
  }
}

// RX rows of x (split, stride K; xr: the same rows as bf16) × NR weight rows from w (stride
// K) into y (row stride N, at the first weight row's column)
template <int RX, int NR>
__attribute__((noinline)) void rowmajor_tile(const float* xs, const uint16_t* xr, const uint16_t* w, uint16_t* y,
                                             int64_t K, int64_t N) {
  const int64_t K16 = K / 16 * 16;
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 a[RX][NR];
#pragma GCC unroll 8
  for (int r = 0; r < RX; ++r)
#pragma GCC unroll 8
    for (int n = 0; n < NR; ++n) a[r][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K16; k += 16) {
#pragma GCC unroll 8
    for (int n = 0; n < NR; ++n) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * K + k));
      if constexpr (simd::kBf16Dot) {
        // lane j: the pair 16c + 2j, 16c + 2j + 1 by one VDPBF16PS, x read as it is stored
#pragma GCC unroll 8
        for (int r = 0; r < RX; ++r) a[r][n] = simd::dot2_bf16(a[r][n], simd::load16_bf16(xr + r * K + k), v);
      } else {
        const __m256 e = even_half(v), o = odd_half(v, hi);
#pragma GCC unroll 8
        for (int r = 0; r < RX; ++r) {
          a[r][n] = _mm256_fmadd_ps(e, simd::load8(xs + r * K + k), a[r][n]);
          a[r][n] = _mm256_fmadd_ps(o, simd::load8(xs + r * K + k + 8), a[r][n]);
        }
      }
    }
  }
  for (int r = 0; r < RX; ++r)
    for (int n = 0; n < NR; ++n) {
      float s = simd::hsum8(a[r][n]);
      for (int64_t k = K16; k < K; ++k)
        s = std::fma(simd::bf16_to_f32(xr[r * K + k]), simd::bf16_to_f32(w[n * K + k]), s);
      y[r * N + n] = simd::f32_to_bf16(s);
    }
}

// only the shapes gemv_rowmajor uses: NR = rowmajor_columns(RX) of a full row group, its
// narrower last row groups (RX smaller, the same NR), and NR = 1 for the last weight rows
template <int RX, int NR>
void rowmajor_shape(const float* xs, const uint16_t* xr, const uint16_t* w, uint16_t* y, int64_t K, int64_t N) {
  if constexpr (NR <= rowmajor_columns(RX)) rowmajor_tile<RX, NR>(xs, xr, w, y, K, N);
}

template <int NR>
void rowmajor_rows(int rows, const float* xs, const uint16_t* xr, const uint16_t* w, uint16_t* y, int64_t K,
                   int64_t N) {
  switch (rows) {
    case 1: rowmajor_shape<1, NR>(xs, xr, w, y, K, N); break;
    case 2: rowmajor_shape<2, NR>(xs, xr, w, y, K, N); break;
    case 3: rowmajor_shape<3, NR>(xs, xr, w, y, K, N); break;
    case 4: rowmajor_shape<4, NR>(xs, xr, w, y, K, N); break;
#if defined(__AVX512VL__)
    case 5: rowmajor_shape<5, NR>(xs, xr, w, y, K, N); break;
    case 6: rowmajor_shape<6, NR>(xs, xr, w, y, K, N); break;
    case 7: rowmajor_shape<7, NR>(xs, xr, w, y, K, N); break;
    case 8: rowmajor_shape<8, NR>(xs, xr, w, y, K, N); break;
#endif
    default: break;  // never: rows <= kRowMajorRows
  }
}

inline void rowmajor_call(int rows, int cols, const float* xs, const uint16_t* xr, const uint16_t* w, uint16_t* y,
                          int64_t K, int64_t N) {
  switch (cols) {
    case 8: rowmajor_rows<8>(rows, xs, xr, w, y, K, N); break;
    case 4: rowmajor_rows<4>(rows, xs, xr, w, y, K, N); break;
    case 2: rowmajor_rows<2>(rows, xs, xr, w, y, K, N); break;
    default: rowmajor_rows<1>(rows, xs, xr, w, y, K, N); break;
  }
}

}  // namespace

void gemv_rowmajor(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t K, int64_t N) {
  if (M <= 0 || N <= 0) return;
  static thread_local std::vector<float> xbuf;
  float* xs = nullptr;  // with bf16 pair dots the tiles read x as it is
  if constexpr (!simd::kBf16Dot) {
    xs = scratch(xbuf, static_cast<size_t>(M * K));
    split_rows(x, xs, M, K);
  }
  const int RX = static_cast<int>(std::min<int64_t>(M, kRowMajorRows));
  const int NR = rowmajor_columns(RX);
  const int64_t units = N / NR;  // NR weight rows each; the N % NR last rows one at a time
  const bool parallel = M * N * K >= kParallelMacs && omp_get_max_threads() > 1;
#pragma omp parallel if (parallel)
  {
    int64_t u0, u1;
    thread_range(units, u0, u1);
    // the last thread also takes the N % NR rows past the units
    const int64_t n0 = u0 * NR, n1 = omp_get_thread_num() + 1 == omp_get_num_threads() ? N : u1 * NR;
    for (int64_t n = n0; n < n1;) {
      const int cols = n + NR <= n1 ? NR : 1;
      for (int64_t m0 = 0; m0 < M; m0 += RX) {
        const int rows = static_cast<int>(std::min<int64_t>(RX, M - m0));
        rowmajor_call(rows, cols, xs ? xs + m0 * K : nullptr, x + m0 * K, w + n * K, y + m0 * N + n, K, N);
      }
      n += cols;
    }
  }
}

}  // namespace gemv
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
