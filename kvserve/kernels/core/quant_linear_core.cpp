// y = x·Wᵀ (+ b) on block-quantized weights at every level, on 8-lane vectors. The compute
// format is llama.cpp's Q8_0 activations against the weights' codes: each row of x is quantized per block of 32 features to int8 (one fp32 scale d_x = amax/127,
// codes round(x·127/amax), and their sum Σq), then per block of 32 weights of one column
//     Σ_k w_k·x_k = d_x · (d_w · Σ_k (c_k − o)·q_k + m_w · Σ_k q_k),   w_k = d_w·c_k + m_w,
// with o = 0 for the formats that store m (Q4_1, Q5_x, Q4_K: kFormat*Min), and for the
// others the offset of the implied minimum m_w = −o·d_w folded into the integer sum
// (o = 128 for Q8_0 and int8, 8 for Q4_0) — the integer sums are exact, so that changes nothing
// but one multiply.
//
// The layout (kernels.h QuantSegment, packed by kvserve/model/quant_formats.py), per group of
// 16 output columns and block of 32 inputs:
//   8-bit codes: 8 vectors of 64 bytes, byte j·64 + 4c + t = c_{col c}[4j + t]
//   4-bit codes: 4 vectors; byte j·64 + 4c + t = c[4j + t] | c[16 + 4j + t] << 4
// Each 64-byte vector is read here as two 32-byte halves, columns 0-7 and 8-15: one
// 4-byte broadcast of x (inputs 4j..4j+3) against a half gives 8 columns' partial dots, so
// the weight bytes stream strictly in order and every accumulator holds 8 columns.
//
// The integer dot products, per level:
//   avx512-vnni  VPDPBUSD (simd::dot4_u8s8) on the unsigned codes as they are: exact. The
//                aarch64 dot levels take this path too (neon-i8mm: USDOT, the same sums;
//                neon-dotprod: SDOT, one for the 4- and 6-bit codes, which are below 128
//                (simd::dot4_u7s8), a correction term more for the 8-bit ones).
//   avx2         VPMADDUBSW saturates its int16 pair sums. 4-bit codes (<= 15) times |q| <= 127
//                are safe, and a whole block's pair sums stay below 8·2·15·127 = 30480, so they
//                accumulate in int16 and widen once per block (VPMADDWD). 8-bit codes are
//                not safe (255·127·2 > 32767): llama.cpp's sign trick, with q = c ^ 0x80
//                signed, multiplies |q| (<= 128, unsigned) by x carrying q's sign (VPSIGNB):
//                Σ q·x exact, and Σ c·x = Σ q·x + 128·Σx. From kPanelMinRows rows, the 8-bit
//                codes of a group are widened once into an int16 panel (q = c − 128) and
//                multiplied by the activations as int16 with VPMADDWD (build_panel): the
//                same exact Σ q·x by fewer uops of the multiply pipes. neon takes this path
//                (x86_vocabulary.h's VPMADDUBSW saturates as x86's does).
// Every level reaches the same exact integers, then the same fp32 operations: the builds agree
// bitwise.
//
// The K-quant formats keep GGUF's own scales, so a Q4_K_M file runs in its own bytes, against
// activations quantized as llama.cpp's Q8_K: one d_x per row and super-block of 256 inputs
// (codes, Σq and Σ of the first 16 still per block of 32), so a super-block's 8 blocks add up
// in int32 and take one fp32 step (column_group_k):
//   Q4_K (kFormatQ4K): the 4-bit codes as Q4_1's, the super-block's fp16 d and dmin, each
//     block's 6-bit sc and mn: d_x·(d·Σ_b sc_b·S_b − dmin·Σ_b mn_b·Σq_b).
//   Q6_K (kFormatQ6K): 6-bit codes c = q + 32 as a 4-bit plane (Q4_0's layout) and a 2-bit
//     plane, and an int8 scale per 16 inputs: per block the two halves' integer sums
//     S_h = Σ (c − 32)·q (Σq of each half from the activations), T_b = sc_0·S_0 + sc_1·S_1,
//     d_x·d·Σ_b T_b. The 6-bit codes are at most 63, so at avx2 VPMADDUBSW's pair sums
//     (<= 2·63·127) add two at a time in int16 before widening.
// A call whose segments mix K-quants and plain formats quantizes x both ways, so a segment's
// bits never depend on the segments it is fused with.
//
// Row invariance: each row's blocks are summed in one order with the same operations
// whatever the tile of rows it lands in (integer sums exact; per row, per block: one
// convert, the scales' multiply-adds, one fused add into the row's accumulator; bias added
// last). Tiles of rows share each weight load; chunks of kChunkRows rows keep their
// quantized x cache-resident while every column group passes. Threads split column
// groups (contiguous ranges: each thread streams its own run of the weight).
#include "quant_linear.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "parallel.h"

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace quant {
namespace {

// rows of x per register tile: 4 at every level. At avx512-vnni 4 ~ 6, 2 ~15% slower (prefill,
// M = 64). At avx2, with 16 registers, a tile of 4 rows keeps some sums in memory, but each
// weight vector's decoding (the 8-bit sign trick, the nibble split, the K-quants' scales) is
// shared by twice the rows: 512 × 2048 → 8192 on Zen 4 at avx2 (python -m benchmarks.kernel_levels
// shapes), Q8_0 94 → 112 GMAC/s, Q4_1 147 → 153, Q4_K 131 → 143, Q6_K 96 → 118, against tiles of 2
constexpr int kTileRows = 4;
// codes this far ahead asked for as each block starts: with the hardware prefetcher alone a
// core pulled the weights at ~10 GB/s (Llama-3.2-1B shape, Q4_0, avx2 decode: 28.5-31.2 ms a
// step against 26.1-27.8 with 8 KiB, 27.3-28.0 with 2 KiB, alternating pairs on Zen 4). On an
// Intel Xeon (Sapphire Rapids kind) 8 KiB ahead streamed slower than 1-2 KiB: 112 cold 1B-shape
// Q4_0 GEMVs, 2 threads, 16.3-18.1 GB/s at 8 KiB, 4 KiB 17.5-17.8, 2 KiB 18.6-20.3, 1 KiB
// 19.0-19.9, no prefetch (1 thread) 9.2 against 10.4-10.6; that 1B's decode 27.6-29.2 ->
// 30.6-32.2 tok/s. 2 KiB: the best here, within Zen 4's noise of 8 KiB there.
constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kChunkRows = 64;  // rows whose quantized x stays cache-resident while every group passes
// below this many (row, group, block) steps the call runs on the calling thread
constexpr int64_t kParallelMinWork = 512;
// Without VNNI the 8-bit formats' sign trick costs three uops of the two pipes that multiply
// (VPSIGNB, VPMADDUBSW, VPMADDWD: measured on Zen 4, VPSIGNB shares them) per 32 products. A
// group's codes widened once into an int16 panel (codes − 128, two inputs per 32-bit lane),
// against activations kept as int16 as well, cost one VPMADDWD per 16 products: where enough
// rows share the panel to pay for its build. The integer sums are the same exact integers.
constexpr bool kWidePanel = !KVSERVE_VNNI_DOT;
// Measured at avx2 on Zen 4, 2048 -> 8192 Q8_0 against the sign trick: 16 rows 2.3-2.5 -> 2.9-3.2
// ms, 24 worse, 32 even, 48 7.3-7.6 -> 6.7-7.2 (the build, and a 64 KiB panel read from L2)
constexpr int64_t kPanelMinRows = 48;
constexpr int64_t kPanelSteps = kBlock / 2;  // 32-bit lanes (two inputs) per column per block
constexpr int kPanelTileRows = 4;             // 6 spilled: 512 x 2048 -> 8192 Q8_0 67-70 -> 89 ms

inline int64_t align64(int64_t n) { return (n + 63) & ~int64_t{63}; }
// a call of M rows may read the 8-bit panel, so its scratch holds the activations as int16 too
inline bool panel_may_run(int64_t M) { return kWidePanel && M >= kPanelMinRows; }

// ---- activations --------------------------------------------------------------------------

inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// the largest |x| of 32 values
template <typename T>
inline float block_amax(const T* x) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(simd::load8(x), abs_mask), _mm256_and_ps(simd::load8(x + 8), abs_mask)),
                                 _mm256_max_ps(_mm256_and_ps(simd::load8(x + 16), abs_mask), _mm256_and_ps(simd::load8(x + 24), abs_mask)));
  return simd::hmax8(a);
}

// 32 values → int8 codes q (round(x·127/amax), nearest even), d = amax/127, s = Σq, s_lo = Σ of
// the first 16 (Q6_K's halves): the rule of the tests' reference, value for value. amax is the
// block's own (block_amax) or, for the K-quants' activations, its super-block's.
template <typename T>
inline void quantize_block(const T* x, float amax, int8_t* q, float* d, int32_t* s, int32_t* s_lo) {
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m256 vi = _mm256_set1_ps(inv);
  // _mm256_cvtps_epi32 rounds to nearest even (the default MXCSR); |x·inv| <= 127
  const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(simd::load8(x), vi));
  const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(simd::load8(x + 8), vi));
  const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(simd::load8(x + 16), vi));
  const __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(simd::load8(x + 24), vi));
  // packs work within 128-bit lanes: lane 0 holds q0..q3's elements 0-3, lane 1 their 4-7
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
  const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  *d = amax / 127.f;
  *s_lo = hsum8_epi32(_mm256_add_epi32(q0, q1));
  *s = *s_lo + hsum8_epi32(_mm256_add_epi32(q2, q3));
}

// ---- weights ------------------------------------------------------------------------------

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

template <int F>
struct Format {
  static constexpr int kBits = F == kFormatQ8 || F == kFormatQ8Min ? 8 : F == kFormatQ6K ? 6 : 4;
  static constexpr bool kHasMin = F == kFormatQ4Min || F == kFormatQ8Min || F == kFormatQ4K;
  static constexpr bool kKQuant = F == kFormatQ4K || F == kFormatQ6K;  // d (dmin) per super-block, small scales in sub
  static constexpr int kOffset = F == kFormatQ8 ? 128 : F == kFormatQ4 ? 8 : 0;  // m = −offset·d
  static constexpr int64_t kBytes = kBits * kGroup * kBlock / 8;                  // per (group, block)
  // block_sums gives Σ (c − kNatural)·q: the avx2 8-bit path sums signed q = c − 128
  static constexpr int kNatural = kBits == 8 && !KVSERVE_VNNI_DOT ? 128 : 0;
};

// A 4-bit (group, block)'s vector j split into its codes: lo0/hi0 inputs 4j..4j+3 and 16+4j..
// of columns 0-7, lo1/hi1 of columns 8-15
inline void nibbles(const uint8_t* codes, int j, __m256i& lo0, __m256i& hi0, __m256i& lo1, __m256i& hi1) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64));
  const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64 + 32));
  lo0 = _mm256_and_si256(w0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), low4);
  lo1 = _mm256_and_si256(w1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), low4);
}

#if !KVSERVE_VNNI_DOT
// The 4-bit formats' int16 pair sums of one (group, block) for R rows at the levels without a
// dot instruction: p[r][h] lanes 2c, 2c+1 hold two halves of Σ_k c_k·q_k of column 8h + c
// (VPMADDUBSW: codes <= 15 times |q| <= 127; |lane| <= 8 product pairs · 2·15·127 = 30480,
// exact in any order). VPMADDWD against ones gives the block's sums, against a column's scale
// the scaled sums (the K-quants).
template <int R>
inline void block_pairs16(const uint8_t* codes, const int8_t* x, int64_t K, __m256i (&p)[R][2]) {
  // Not unrolled: with 4 rows the full unroll keeps 4 weight pairs and 8 pair sums live and
  // GCC spills them to the stack (measured at avx2, 512x2048->8192: Q4_1 150 -> 200 GMAC/s).
  // Splitting the halves (8 columns at a time, fully unrolled) ran 200 -> 134 GMAC/s on Q4_K.
#pragma GCC unroll 1
  for (int j = 0; j < 4; ++j) {
    __m256i lo0, hi0, lo1, hi1;
    nibbles(codes, j, lo0, hi0, lo1, hi1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i bl = bcast4(x + r * K + 4 * j), bh = bcast4(x + r * K + 16 + 4 * j);
      const __m256i t0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, bl), _mm256_maddubs_epi16(hi0, bh));
      const __m256i t1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, bl), _mm256_maddubs_epi16(hi1, bh));
      p[r][0] = j ? _mm256_add_epi16(p[r][0], t0) : t0;
      p[r][1] = j ? _mm256_add_epi16(p[r][1], t1) : t1;
    }
  }
}
#endif

#if defined(__aarch64__) && defined(__ARM_FEATURE_MATMUL_INT8)
// neon-i8mm: USMMLA (vusmmlaq_s32) multiplies a 2 × 8 matrix of unsigned bytes by the transpose
// of a 2 × 8 one of signed bytes into 2 × 2 int32: 32 products an instruction where USDOT
// takes 16. Its operands are two columns' 8 consecutive inputs and two rows' 8 inputs. The
// layout above holds a column's inputs 4 at a time, 16 columns a vector, so one 32-bit zip of
// vectors j and j + 1 gives two columns' 8 inputs 4j..4j+7 (4-bit: the nibble pairs, lows
// inputs 4j.., highs 16 + 4j..), in registers, shared by every pair of rows: no second layout
// of the weights. Whether llama.cpp's load-time interleave (its 4×8 repack) would pay more than
// the zips is for an ARM machine to say. The sums are the exact integers of USDOT's path, so a
// row's bits do not depend on the path its tile takes.

// C[p] += the 2 × 2 products of column pair p (w[p]) and the rows' pair (xo), p = 0..7
inline void mmla8(int32x4_t (&C)[8], const uint8x16_t (&w)[8], int8x16_t xo) {
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) C[p] = vusmmlaq_s32(C[p], w[p], xo);
}

// the 8 column pairs (2p, 2p + 1) of vectors j and j + 1: 8 consecutive inputs a column
inline void zip_pairs(const uint8_t* codes, int j, uint8x16_t (&w)[8]) {
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    const uint32x4_t a = vreinterpretq_u32_u8(vld1q_u8(codes + j * 64 + 16 * q));
    const uint32x4_t b = vreinterpretq_u32_u8(vld1q_u8(codes + (j + 1) * 64 + 16 * q));
    w[2 * q] = vreinterpretq_u8_u32(vzip1q_u32(a, b));
    w[2 * q + 1] = vreinterpretq_u8_u32(vzip2q_u32(a, b));
  }
}

// rows 2i and 2i + 1's inputs at offset o, 8 each
inline int8x16_t row_pair(const int8_t* x, int64_t K, int i, int64_t o) {
  return vcombine_s8(vld1_s8(x + 2 * i * K + o), vld1_s8(x + (2 * i + 1) * K + o));
}

// block_sums by USMMLA for an even R: C[i][p] = [col 2p·row 2i, col 2p·row 2i+1, col 2p+1·row 2i,
// col 2p+1·row 2i+1], unzipped at the end into S's rows of 8 columns
template <int F, int R>
inline void block_sums_mmla(const uint8_t* codes, const int8_t* x, int64_t K, __m256i (&S)[R][2]) {
  static_assert(R % 2 == 0, "USMMLA takes rows in pairs");
  constexpr int P = R / 2;
  int32x4_t C[P][8];
  for (int i = 0; i < P; ++i)
    for (int p = 0; p < 8; ++p) C[i][p] = vdupq_n_s32(0);
  if constexpr (Format<F>::kBits == 4) {
    const uint8x16_t low4 = vdupq_n_u8(0x0f);
#pragma GCC unroll 2
    for (int j = 0; j < 4; j += 2) {
      uint8x16_t z[8], lo[8], hi[8];
      zip_pairs(codes, j, z);
      for (int p = 0; p < 8; ++p) lo[p] = vandq_u8(z[p], low4), hi[p] = vshrq_n_u8(z[p], 4);
#pragma GCC unroll 4
      for (int i = 0; i < P; ++i) {
        mmla8(C[i], lo, row_pair(x, K, i, 4 * j));
        mmla8(C[i], hi, row_pair(x, K, i, 16 + 4 * j));
      }
    }
  } else {
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
      uint8x16_t w[8];
      zip_pairs(codes, j, w);
#pragma GCC unroll 4
      for (int i = 0; i < P; ++i) mmla8(C[i], w, row_pair(x, K, i, 4 * j));
    }
  }
  for (int i = 0; i < P; ++i)
    for (int h = 0; h < 2; ++h) {
      const int32x4_t* c = C[i] + 4 * h;  // pairs 4h..4h+3: columns 8h..8h+7
      S[2 * i][h] = simd::neon_dot::join(vuzp1q_s32(c[0], c[1]), vuzp1q_s32(c[2], c[3]));
      S[2 * i + 1][h] = simd::neon_dot::join(vuzp2q_s32(c[0], c[1]), vuzp2q_s32(c[2], c[3]));
    }
}
#endif

// The integer sums of one (group, block) for R rows: S[r][h] = Σ_k (c_k − kNatural)·q_k for
// columns 8h..8h+7 of the group, exact. x: the block's first quantized input of row 0 (rows K apart).
template <int F, int R>
inline void block_sums(const uint8_t* codes, const int8_t* x, int64_t K, __m256i (&S)[R][2]) {
  [[maybe_unused]] constexpr int A = R <= 2 ? 2 : 1;  // independent chains per sum where rows are few (VNNI latency)
#if defined(__aarch64__) && defined(__ARM_FEATURE_MATMUL_INT8)
  if constexpr (R % 2 == 0) return block_sums_mmla<F, R>(codes, x, K, S);
#endif
  if constexpr (Format<F>::kBits == 4) {
#if KVSERVE_VNNI_DOT
    __m256i acc[A][R][2];
    for (int a = 0; a < A; ++a)
      for (int r = 0; r < R; ++r) acc[a][r][0] = acc[a][r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256i lo0, hi0, lo1, hi1;
      nibbles(codes, j, lo0, hi0, lo1, hi1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i bl = bcast4(x + r * K + 4 * j), bh = bcast4(x + r * K + 16 + 4 * j);
        acc[0][r][0] = simd::dot4_u7s8(acc[0][r][0], lo0, bl);
        acc[0][r][1] = simd::dot4_u7s8(acc[0][r][1], lo1, bl);
        acc[A - 1][r][0] = simd::dot4_u7s8(acc[A - 1][r][0], hi0, bh);
        acc[A - 1][r][1] = simd::dot4_u7s8(acc[A - 1][r][1], hi1, bh);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) S[r][h] = A > 1 ? _mm256_add_epi32(acc[0][r][h], acc[A - 1][r][h]) : acc[0][r][h];
#else
    __m256i p[R][2];
    block_pairs16<R>(codes, x, K, p);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) S[r][h] = _mm256_madd_epi16(p[r][h], ones);
#endif
  } else {
#if KVSERVE_VNNI_DOT
    __m256i acc[A][R][2];
    for (int a = 0; a < A; ++a)
      for (int r = 0; r < R; ++r) acc[a][r][0] = acc[a][r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64 + 32));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i b = bcast4(x + r * K + 4 * j);
        acc[j % A][r][0] = simd::dot4_u8s8(acc[j % A][r][0], w0, b);
        acc[j % A][r][1] = simd::dot4_u8s8(acc[j % A][r][1], w1, b);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) S[r][h] = A > 1 ? _mm256_add_epi32(acc[0][r][h], acc[A - 1][r][h]) : acc[0][r][h];
#else
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) S[r][0] = S[r][1] = _mm256_setzero_si256();
    // Unrolled twice, not eight times: the full unroll spills the sign-trick temporaries
    // (measured at avx2, 512x2048->8192: Q8_0 ~110 -> 122 GMAC/s; batch-1 no worse).
#pragma GCC unroll 2
    for (int j = 0; j < 8; ++j) {
      const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64)), flip);
      const __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64 + 32)), flip);
      const __m256i a0 = _mm256_abs_epi8(q0), a1 = _mm256_abs_epi8(q1);  // <= 128: unsigned bytes
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i b = bcast4(x + r * K + 4 * j);  // |b| <= 127: negating it is safe
        // pair sums <= 2·128·127 = 32512: exact in int16
        S[r][0] = _mm256_add_epi32(S[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(b, q0)), ones));
        S[r][1] = _mm256_add_epi32(S[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(b, q1)), ones));
      }
    }
#endif
  }
}

// Q6_K's integer sums of one (group, block) for R rows, per half: L[r][h] = Σ_{k<16} c_k·q_k and
// H[r][h] = Σ_{k>=16} c_k·q_k for columns 8h..8h+7, c the 6-bit code (offset not removed), exact.
// The 4-bit plane is Q4_0's layout (vector j: inputs 4j..4j+3 low, 16+4j.. high); byte
// (j/2)·64 + 4c + t of the 2-bit plane holds, from bit 4·(j%2), the top bits of input 4j + t then
// of input 16 + 4j + t.
template <int R>
inline void block_sums6(const uint8_t* codes, const int8_t* x, int64_t K, __m256i (&L)[R][2], __m256i (&H)[R][2]) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
  const uint8_t* top = codes + 256;
#if !KVSERVE_VNNI_DOT
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i pl[R][2], ph[R][2];  // int16 pair sums of two vectors (<= 2·2·63·127 = 32004)
#endif
  for (int r = 0; r < R; ++r) L[r][0] = L[r][1] = H[r][0] = H[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    __m256i lo[2], hi[2];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64 + 32 * h));
      const __m256i t = _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(top + (j / 2) * 64 + 32 * h)),
                                          4 * (j % 2));
      lo[h] = _mm256_or_si256(_mm256_and_si256(w, low4), _mm256_slli_epi16(_mm256_and_si256(t, low2), 4));
      hi[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), low4),
                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(t, 2), low2), 4));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i bl = bcast4(x + r * K + 4 * j), bh = bcast4(x + r * K + 16 + 4 * j);
#if KVSERVE_VNNI_DOT
      for (int h = 0; h < 2; ++h) {
        L[r][h] = simd::dot4_u7s8(L[r][h], lo[h], bl);
        H[r][h] = simd::dot4_u7s8(H[r][h], hi[h], bh);
      }
#else
      for (int h = 0; h < 2; ++h) {
        const __m256i a = _mm256_maddubs_epi16(lo[h], bl), b = _mm256_maddubs_epi16(hi[h], bh);
        pl[r][h] = j % 2 ? _mm256_add_epi16(pl[r][h], a) : a;
        ph[r][h] = j % 2 ? _mm256_add_epi16(ph[r][h], b) : b;
        if (j % 2) {
          L[r][h] = _mm256_add_epi32(L[r][h], _mm256_madd_epi16(pl[r][h], ones));
          H[r][h] = _mm256_add_epi32(H[r][h], _mm256_madd_epi16(ph[r][h], ones));
        }
      }
#endif
    }
  }
}

// The 8-bit block sums from a panel block (kWidePanel): S[r][h] = Σ_k (c_k − 128)·q_k for columns
// 8h..8h+7, exact (|Σ| <= 32·128·127). panel: step s, half h at (s·2 + h)·16: lane c holds the
// codes − 128 of inputs 2s, 2s+1 of column 8h + c; x16: the block's first input of row 0 as
// int16 (rows K apart).
template <int R>
inline void block_sums_panel(const int16_t* panel, const int16_t* x16, int64_t K, __m256i (&S)[R][2]) {
  for (int r = 0; r < R; ++r) S[r][0] = S[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int s = 0; s < kPanelSteps; ++s) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + s * 32));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + s * 32 + 16));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x16 + r * K + 2 * s, sizeof(pair));
      const __m256i b = _mm256_set1_epi32(pair);
      S[r][0] = _mm256_add_epi32(S[r][0], _mm256_madd_epi16(w0, b));
      S[r][1] = _mm256_add_epi32(S[r][1], _mm256_madd_epi16(w1, b));
    }
  }
}

// Group g's 8-bit codes as the panel block_sums_panel reads: [K/32 blocks][16 steps][2 halves][8 lanes × 2]
inline void build_panel(const uint8_t* codes, int64_t KB, int16_t* panel) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < KB; ++b)
    for (int j = 0; j < 8; ++j)
      for (int h = 0; h < 2; ++h) {
        // 32 bytes: columns 8h..8h+7, inputs 4j..4j+3 each (byte 4c + t)
        const __m256i q = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * 512 + j * 64 + 32 * h)), flip);
        // int16, 32-bit lanes: A = (c0 t01, c0 t23, c1 t01, ..., c3 t23), B the same for c4..c7
        const __m256 A = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)));
        const __m256 B = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)));
        // within 128-bit lanes: (c0, c1, c4, c5 | c2, c3, c6, c7); the 64-bit swap puts columns in order
        const __m256i lo = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(A, B, _MM_SHUFFLE(2, 0, 2, 0))),
                                                    _MM_SHUFFLE(3, 1, 2, 0));
        const __m256i hi = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(A, B, _MM_SHUFFLE(3, 1, 3, 1))),
                                                    _MM_SHUFFLE(3, 1, 2, 0));
        int16_t* out = panel + (b * kPanelSteps + 2 * j) * 32 + 16 * h;
        _mm256_store_si256(reinterpret_cast<__m256i*>(out), lo);        // step 2j: inputs 4j, 4j+1
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32), hi);   // step 2j+1: inputs 4j+2, 4j+3
      }
}

inline void store_row(float* y, __m256 v) { simd::store8(y, v); }
inline void store_row(uint16_t* y, __m256 v) { simd::store8(y, v); }

// R rows of x (quantized) against group g of segment w: y[r][col .. col + 16)
// 8 small integer scales (uint8 or int8) widened to int32
inline __m256i load8_u8_epi32(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i load8_i8_epi32(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// The rows' fp32 sums of a column group. With 16 registers a tile's block sums (2 per row) and
// its fp32 sums (2 per row) are all 16 of them, so GCC spilled block sums inside the integer
// loop, the chain that runs every 4 inputs; the fp32 sums, touched once a block, sit in L1
// instead (their address escapes at each block's `touch`, so each block loads and stores them).
// Memory or register, the same operations in the same order: nothing changes a bit.
template <int R>
struct RowSums {
  static constexpr bool kInMemory = simd::kVecRegs == 16 && R >= 3;
  alignas(32) float mem[R][2][8];
  __m256 reg[R][2];
  RowSums() {
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        reg[r][h] = _mm256_setzero_ps();
        if constexpr (kInMemory) _mm256_store_ps(mem[r][h], reg[r][h]);
      }
  }
  void touch() {
    if constexpr (kInMemory) asm volatile("" : : "r"(&mem[0][0][0]) : "memory");
  }
  // sum[r][h] += t · dx, one fused multiply-add
  void add(int r, int h, __m256 t, __m256 dx) {
    if constexpr (kInMemory)
      _mm256_store_ps(mem[r][h], _mm256_fmadd_ps(t, dx, _mm256_load_ps(mem[r][h])));
    else
      reg[r][h] = _mm256_fmadd_ps(t, dx, reg[r][h]);
  }
  template <typename Out>
  void store(const uint16_t* bias, Out* y, int64_t ldy, int64_t col) {
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        __m256 v = kInMemory ? _mm256_load_ps(mem[r][h]) : reg[r][h];
        if (bias) v = _mm256_add_ps(v, simd::load8(bias + col + 8 * h));
        store_row(y + r * ldy + col + 8 * h, v);
      }
  }
};

inline void prefetch_block(const uint8_t* codes, int64_t bytes) {
#pragma GCC unroll 8
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(codes) + kPrefetchBytes + line, _MM_HINT_T0);
}

// R rows of x (quantized per block of 32) against group g of segment w, a plain format:
// y[r][col .. col + 16). panel (8-bit formats, kWidePanel): the group's codes from build_panel
// and x16 the tile's activations as int16; the codes otherwise.
template <int F, int R, typename Out>
void column_group(const SegmentView& w, int64_t g, const int8_t* xq, const float* xd, const int32_t* xs, int64_t K,
                  const uint16_t* bias, Out* y, int64_t ldy, int64_t col, const int16_t* panel, const int16_t* x16) {
  using Fmt = Format<F>;
  static_assert(!Fmt::kKQuant, "the K-quants run column_group_k");
  const int64_t KB = K / kBlock;
  const uint8_t* codes = w.codes + g * KB * Fmt::kBytes;
  const int64_t param_blocks = w.per_channel ? 1 : KB;
  const uint16_t* scales = w.scales + g * param_blocks * kGroup;
  const uint16_t* mins = Fmt::kHasMin ? w.mins + g * param_blocks * kGroup : nullptr;
  constexpr int kFold = Fmt::kHasMin ? Fmt::kNatural : Fmt::kNatural - Fmt::kOffset;  // T = S + kFold·Σq
  RowSums<R> acc;
  for (int64_t b = 0; b < KB; ++b, codes += Fmt::kBytes) {
    acc.touch();
    if (!panel) prefetch_block(codes, Fmt::kBytes);
    const uint16_t* bs = scales + (w.per_channel ? 0 : b) * kGroup;
    __m256i S[R][2];
    if constexpr (kWidePanel && Fmt::kBits == 8) {
      if (panel) block_sums_panel<R>(panel + b * kPanelSteps * 32, x16 + b * kBlock, K, S);
      else block_sums<F, R>(codes, xq + b * kBlock, K, S);
    } else {
      block_sums<F, R>(codes, xq + b * kBlock, K, S);
    }
    __m256 d[2], m[2];
    d[0] = simd::load8_f16(bs);
    d[1] = simd::load8_f16(bs + 8);
    if constexpr (Fmt::kHasMin) {
      m[0] = simd::load8_f16(mins + b * kGroup);
      m[1] = simd::load8_f16(mins + b * kGroup + 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int32_t sx = xs[r * KB + b];
      const __m256 dx = _mm256_set1_ps(xd[r * KB + b]);
      for (int h = 0; h < 2; ++h) {
        __m256i T = S[r][h];
        if constexpr (kFold != 0) T = _mm256_add_epi32(T, _mm256_set1_epi32(kFold * sx));
        __m256 t;
        if constexpr (Fmt::kHasMin)
          t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T), d[h], _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(sx)), m[h]));
        else
          t = _mm256_mul_ps(_mm256_cvtepi32_ps(T), d[h]);
        acc.add(r, h, t, dx);
      }
    }
  }
  acc.store(bias, y, ldy, col);
}

// The K-quants, against activations quantized per super-block (quantize_rows' K-quant view: one
// d_x per 256 inputs, as llama.cpp's Q8_K): each block's integer sums times its small integer
// scales add up in int32 across the super-block's 8 blocks, then one fp32 step per super-block
// instead of one per block:
//   Q4_K  d_x · (d · Σ_b sc_b·S_b − dmin · Σ_b mn_b·Σq_b),  S_b = Σ_k c_k·q_k
//   Q6_K  d_x · d · Σ_b (sc_lo,b · (L_b − 32·Σq_lo,b) + sc_hi,b · (H_b − 32·Σq_hi,b))
// |Σ_b sc_b·S_b| <= 8·63·32·15·127 (30.7M) and Q6_K's <= 8·2·128·16·32·127 (133M) fit int32; the
// conversion to fp32 rounds once a super-block where they pass 2^24, the same in every build.
// At the levels without a dot instruction Q4_K's scales ride on the VPMADDWD that widens the
// pair sums (block_pairs16), so scaling costs nothing; with one, a VPMULLD per block.
template <int F, int R, typename Out>
void column_group_k(const SegmentView& w, int64_t g, const int8_t* xq, const float* xd, const int32_t* xs,
                    const int32_t* xs_lo, int64_t K, const uint16_t* bias, Out* y, int64_t ldy, int64_t col) {
  using Fmt = Format<F>;
  static_assert(Fmt::kKQuant, "column_group_k runs the K-quants");
  constexpr int kPer = kSuper / kBlock;
  const int64_t KB = K / kBlock, SB = K / kSuper;
  const uint8_t* codes = w.codes + g * KB * Fmt::kBytes;
  const uint16_t* scales = w.scales + g * SB * kGroup;
  const uint16_t* mins = F == kFormatQ4K ? w.mins + g * SB * kGroup : nullptr;
  const uint8_t* sub = w.sub + g * KB * 2 * kGroup;
  RowSums<R> acc;
  for (int64_t sb = 0; sb < SB; ++sb) {
    acc.touch();
    __m256i A[R][2];
    for (int r = 0; r < R; ++r) A[r][0] = A[r][1] = _mm256_setzero_si256();
    for (int64_t b = sb * kPer; b < (sb + 1) * kPer; ++b, codes += Fmt::kBytes) {
      prefetch_block(codes, Fmt::kBytes);
      const uint8_t* sc = sub + b * 2 * kGroup;
      if constexpr (F == kFormatQ6K) {
        __m256i L[R][2], H[R][2];
        block_sums6<R>(codes, xq + b * kBlock, K, L, H);
        const __m256i sc_lo[2] = {load8_i8_epi32(sc), load8_i8_epi32(sc + 8)};
        const __m256i sc_hi[2] = {load8_i8_epi32(sc + 16), load8_i8_epi32(sc + 24)};
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int32_t sl = xs_lo[r * KB + b], sh = xs[r * KB + b] - sl;
          for (int h = 0; h < 2; ++h) {
            const __m256i lo = _mm256_sub_epi32(L[r][h], _mm256_set1_epi32(32 * sl));
            const __m256i hi = _mm256_sub_epi32(H[r][h], _mm256_set1_epi32(32 * sh));
            A[r][h] = _mm256_add_epi32(
                A[r][h], _mm256_add_epi32(_mm256_mullo_epi32(lo, sc_lo[h]), _mm256_mullo_epi32(hi, sc_hi[h])));
          }
        }
      } else {
#if KVSERVE_VNNI_DOT
        __m256i S[R][2];
        block_sums<F, R>(codes, xq + b * kBlock, K, S);
        const __m256i s32[2] = {load8_u8_epi32(sc), load8_u8_epi32(sc + 8)};
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) A[r][h] = _mm256_add_epi32(A[r][h], _mm256_mullo_epi32(S[r][h], s32[h]));
#else
        __m256i p[R][2];
        block_pairs16<R>(codes, xq + b * kBlock, K, p);
        __m256i s16[2];  // the column's scale in both int16 halves of its 32-bit lane
        for (int h = 0; h < 2; ++h) {
          const __m256i v = load8_u8_epi32(sc + 8 * h);
          s16[h] = _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) A[r][h] = _mm256_add_epi32(A[r][h], _mm256_madd_epi16(p[r][h], s16[h]));
#endif
      }
    }
    const uint16_t* ds = scales + sb * kGroup;
    const __m256 d[2] = {simd::load8_f16(ds), simd::load8_f16(ds + 8)};
    if constexpr (F == kFormatQ4K) {
      // Σ_b mn_b·Σq_b, two blocks a VPMADDWD: mn (<= 63) and Σq (|Σq| <= 32·127) as int16 pairs
      __m256i B[R][2];
      for (int r = 0; r < R; ++r) B[r][0] = B[r][1] = _mm256_setzero_si256();
      const uint8_t* mn = sub + sb * kPer * 2 * kGroup + kGroup;
#pragma GCC unroll 4
      for (int i = 0; i < kPer / 2; ++i) {
        __m256i pair[2];
        for (int h = 0; h < 2; ++h)
          pair[h] = _mm256_or_si256(load8_u8_epi32(mn + 2 * i * 2 * kGroup + 8 * h),
                                    _mm256_slli_epi32(load8_u8_epi32(mn + (2 * i + 1) * 2 * kGroup + 8 * h), 16));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int32_t* s = xs + r * KB + sb * kPer + 2 * i;
          const uint32_t two = (static_cast<uint32_t>(s[0]) & 0xffffu) | (static_cast<uint32_t>(s[1]) << 16);
          const __m256i sv = _mm256_set1_epi32(static_cast<int32_t>(two));
          for (int h = 0; h < 2; ++h) B[r][h] = _mm256_add_epi32(B[r][h], _mm256_madd_epi16(pair[h], sv));
        }
      }
      const __m256 dmin[2] = {simd::load8_f16(mins + sb * kGroup), simd::load8_f16(mins + sb * kGroup + 8)};
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(xd[r * KB + sb * kPer]);
        for (int h = 0; h < 2; ++h)
          acc.add(r, h,
                  _mm256_fmsub_ps(_mm256_cvtepi32_ps(A[r][h]), d[h], _mm256_mul_ps(_mm256_cvtepi32_ps(B[r][h]), dmin[h])),
                  dx);
      }
    } else {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(xd[r * KB + sb * kPer]);
        for (int h = 0; h < 2; ++h) acc.add(r, h, _mm256_mul_ps(_mm256_cvtepi32_ps(A[r][h]), d[h]), dx);
      }
    }
  }
  acc.store(bias, y, ldy, col);
}

// The quantized activations of the rows a tile starts at: codes [rows, K], per block of 32 the
// scale, Σq and Σ of its first 16 (rows K / 32 apart)
struct XRows {
  int8_t* q;
  float* d;
  int32_t* s;
  int32_t* s_lo;
  XRows at(int64_t row, int64_t K) const {
    if (!q) return *this;
    const int64_t KB = K / kBlock;
    return {q + row * K, d + row * KB, s + row * KB, s_lo + row * KB};
  }
};

// Each format's view of the rows: `block` quantized per block of 32 (d_x per block, the plain
// formats' Q8_0 activations), `super` per super-block of 256 (one d_x for its 8 blocks, stored
// in each: the K-quants'). A call quantizes only the views its segments read, so a segment's
// result never depends on the formats beside it.
struct XView {
  XRows block, super;
  const int16_t* q16;  // block's codes as int16 (kWidePanel, calls of kPanelMinRows rows or more), else nullptr
  XView at(int64_t row, int64_t K) const { return {block.at(row, K), super.at(row, K), q16 ? q16 + row * K : nullptr}; }
};

// n (1..R) rows: column_group<F, n>
template <int F, int R, typename Out>
inline void tile(int64_t n, const SegmentView& w, int64_t g, const XView& x, int64_t K, const uint16_t* bias, Out* y,
                 int64_t ldy, int64_t col, const int16_t* panel) {
  if constexpr (R > 1)
    if (n < R) return tile<F, R - 1>(n, w, g, x, K, bias, y, ldy, col, panel);
  if constexpr (Format<F>::kKQuant)
    column_group_k<F, R>(w, g, x.super.q, x.super.d, x.super.s, x.super.s_lo, K, bias, y, ldy, col);
  else
    column_group<F, R>(w, g, x.block.q, x.block.d, x.block.s, K, bias, y, ldy, col, panel, x.q16);
}

template <int F, typename Out>
void rows_of_group(int64_t rows, const SegmentView& w, int64_t g, const XView& x, int64_t K, const uint16_t* bias,
                   Out* y, int64_t ldy, int64_t col) {
  if constexpr (kWidePanel && Format<F>::kBits == 8) {
    if (x.q16 && rows >= kPanelMinRows) {
      // one per thread, reused by every group it takes (K·32 bytes: 64 KiB at K = 2048)
      thread_local std::vector<int16_t> buffer;
      const int64_t KB = K / kBlock;
      buffer.resize(static_cast<size_t>(KB * kPanelSteps * 32 + 16));  // + 32 bytes to align the start
      int16_t* panel = reinterpret_cast<int16_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 31) & ~uintptr_t{31});
      build_panel(w.codes + g * KB * Format<F>::kBytes, KB, panel);
      for (int64_t r0 = 0; r0 < rows; r0 += kPanelTileRows)
        tile<F, kPanelTileRows>(std::min<int64_t>(kPanelTileRows, rows - r0), w, g, x.at(r0, K), K, bias,
                                y + r0 * ldy, ldy, col, panel);
      return;
    }
  }
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows)
    tile<F, kTileRows>(std::min<int64_t>(kTileRows, rows - r0), w, g, x.at(r0, K), K, bias, y + r0 * ldy, ldy, col,
                       nullptr);
}

template <typename Out>
void run_group(int64_t rows, const SegmentView& w, int64_t g, const XView& x, int64_t K, const uint16_t* bias, Out* y,
               int64_t ldy, int64_t col) {
  switch (w.format) {
    case kFormatQ8: rows_of_group<kFormatQ8>(rows, w, g, x, K, bias, y, ldy, col); break;
    case kFormatQ8Min: rows_of_group<kFormatQ8Min>(rows, w, g, x, K, bias, y, ldy, col); break;
    case kFormatQ4: rows_of_group<kFormatQ4>(rows, w, g, x, K, bias, y, ldy, col); break;
    case kFormatQ4K: rows_of_group<kFormatQ4K>(rows, w, g, x, K, bias, y, ldy, col); break;
    case kFormatQ6K: rows_of_group<kFormatQ6K>(rows, w, g, x, K, bias, y, ldy, col); break;
    default: rows_of_group<kFormatQ4Min>(rows, w, g, x, K, bias, y, ldy, col); break;
  }
}

template <typename Out>
void run_all(int64_t M, int64_t K, const SegmentView* segs, int64_t num_segs, const XView& x, const uint16_t* bias,
             Out* y) {
  std::vector<int64_t> first_group{0};  // the flat index of each segment's first group
  for (int64_t i = 0; i < num_segs; ++i) first_group.push_back(first_group.back() + segs[i].groups);
  const int64_t groups = first_group.back(), KB = K / kBlock, N = groups * kGroup;
  const bool parallel = M * groups * KB >= kParallelMinWork;
  auto group = [&](int64_t r0, int64_t rows, int64_t g) {
    const int64_t si = std::upper_bound(first_group.begin(), first_group.end(), g) - first_group.begin() - 1;
    run_group(rows, segs[si], g - first_group[si], x.at(r0, K), K, bias, y + r0 * N, N, g * kGroup);
  };
  if (M <= kChunkRows) {  // decode and small batches: bound by the weights' stream, threads steal (parallel.h)
    const int threads = parallel ? omp_get_max_threads() : 1;
    StealingRange range(groups, threads, groups / (16 * threads));
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      int64_t b, e;
      while (range.next(omp_get_thread_num(), b, e))
        for (int64_t g = b; g < e; ++g) group(0, M, g);
    }
    return;
  }
  // chunks of rows: per chunk, each thread's run of groups, the back of another's once its own
  // is done, and on to the next chunk without waiting (a static split with a barrier per chunk
  // left the faster core waiting for the slower at each: 512-token prefills alternated in one
  // process at avx2 on Zen 4, the default model's Q8_0 636 -> 601 ms, a Llama-3.2-1B-shape
  // Q4_K_M 3,430 -> 3,138 ms)
  const int threads = parallel ? omp_get_max_threads() : 1;
  std::vector<std::unique_ptr<StealingRange>> runs;
  for (int64_t r0 = 0; r0 < M; r0 += kChunkRows)
    runs.emplace_back(new StealingRange(groups, threads, groups / (16 * threads)));
#pragma omp parallel num_threads(threads) if (threads > 1)
  for (int64_t r0 = 0, c = 0; r0 < M; r0 += kChunkRows, ++c) {
    const int64_t rows = std::min(kChunkRows, M - r0);
    int64_t b, e;
    while (runs[c]->next(omp_get_thread_num(), b, e))
      for (int64_t g = b; g < e; ++g) group(r0, rows, g);
  }
}

}  // namespace

namespace {
// bytes of one XRows of M rows: codes, then per block d, Σq, Σ of the first 16
inline int64_t rows_bytes(int64_t M, int64_t K) { return align64(M * K) + 3 * align64(M * (K / kBlock) * 4); }
}  // namespace

size_t quant_linear_scratch_bytes(int64_t M, int64_t K) {
  const int64_t wide = panel_may_run(M) ? align64(M * K * 2) : 0;  // the int16 codes
  return static_cast<size_t>(2 * rows_bytes(M, K) + wide);         // the per-block and the per-super-block view
}

namespace {

XRows rows_at(char* base, int64_t M, int64_t K) {
  const int64_t KB = K / kBlock;
  return {reinterpret_cast<int8_t*>(base), reinterpret_cast<float*>(base + align64(M * K)),
          reinterpret_cast<int32_t*>(base + align64(M * K) + align64(M * KB * 4)),
          reinterpret_cast<int32_t*>(base + align64(M * K) + 2 * align64(M * KB * 4))};
}

// x's rows quantized into `scratch` (quant_linear_scratch_bytes(M, K)): per block of 32 where a
// plain segment reads them, per super-block where a K-quant one does, and the int16 copy where
// an 8-bit segment will read the panel
XView quantize_rows(const void* x, bool x_bf16, int64_t M, int64_t K, const SegmentView* segs, int64_t num_segs,
                    void* scratch) {
  const int64_t KB = K / kBlock;
  char* base = static_cast<char*>(scratch);
  bool plain = false, k_quant = false, wide = false;  // wide: an 8-bit segment reads rows_of_group's panel
  for (int64_t i = 0; i < num_segs; ++i) {
    const bool kq = format_is_k_quant(segs[i].format);
    k_quant = k_quant || kq;
    plain = plain || !kq;
    wide = wide || (panel_may_run(M) && format_bits(segs[i].format) == 8);
  }
  XView v{};
  if (plain) v.block = rows_at(base, M, K);
  if (k_quant) v.super = rows_at(base + rows_bytes(M, K), M, K);
  int16_t* xq16 = wide ? reinterpret_cast<int16_t*>(base + 2 * rows_bytes(M, K)) : nullptr;
  v.q16 = xq16;
  auto quantize = [&](int64_t off, float amax, const XRows& o, int64_t i) {
    if (x_bf16) quantize_block(static_cast<const uint16_t*>(x) + off, amax, o.q + off, o.d + i, o.s + i, o.s_lo + i);
    else quantize_block(static_cast<const float*>(x) + off, amax, o.q + off, o.d + i, o.s + i, o.s_lo + i);
  };
  auto amax_of = [&](int64_t off) {
    return x_bf16 ? block_amax(static_cast<const uint16_t*>(x) + off) : block_amax(static_cast<const float*>(x) + off);
  };
  // each block (super-block) on its own: the split between threads cannot change a value
  const int64_t blocks = M * KB;
  if (plain) {
#pragma omp parallel for schedule(static) if (blocks >= 2048)
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t off = (i / KB) * K + (i % KB) * kBlock;
      quantize(off, amax_of(off), v.block, i);
      if (xq16) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v.block.q + off));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq16 + off), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq16 + off + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)));
      }
    }
  }
  if (k_quant) {
    constexpr int64_t kPer = kSuper / kBlock;
    const int64_t supers = blocks / kPer;
#pragma omp parallel for schedule(static) if (blocks >= 2048)
    for (int64_t j = 0; j < supers; ++j) {
      const int64_t i0 = j * kPer, off0 = (i0 / KB) * K + (i0 % KB) * kBlock;  // K-quant depths: K % 256 == 0
      float amax = 0.f;
      for (int64_t b = 0; b < kPer; ++b) amax = std::max(amax, amax_of(off0 + b * kBlock));
      for (int64_t b = 0; b < kPer; ++b) quantize(off0 + b * kBlock, amax, v.super, i0 + b);
    }
  }
  return v;
}

// Every row's own weight, one stealing pass over all (row, group) items: an item is one row
// against one column group of its weight, rows_of_group(1, ...) as quant_linear runs a row alone.
template <typename Out>
void run_rows(int64_t R, int64_t K, const SegmentView* segs, const int64_t* first, const XView& x, Out* y) {
  int64_t N = 0;
  for (int64_t i = first[0]; i < first[1]; ++i) N += segs[i].groups * kGroup;
  const int64_t groups = N / kGroup, KB = K / kBlock;
  const int threads = R * groups * KB >= kParallelMinWork ? omp_get_max_threads() : 1;
  StealingRange range(R * groups, threads, R * groups / (16 * threads));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    int64_t b, e;
    while (range.next(omp_get_thread_num(), b, e))
      for (int64_t item = b; item < e; ++item) {
        const int64_t r = item / groups;
        int64_t g = item % groups, si = first[r];
        while (g >= segs[si].groups) g -= segs[si++].groups;
        run_group(1, segs[si], g, x.at(r, K), K, nullptr, y + r * N, N, (item % groups) * kGroup);
      }
  }
}

}  // namespace

void quant_linear(const void* x, bool x_bf16, int64_t M, int64_t K, const SegmentView* segs, int64_t num_segs,
                  const uint16_t* bias, void* y, bool y_bf16, void* scratch) {
  if (M <= 0) return;
  const XView xv = quantize_rows(x, x_bf16, M, K, segs, num_segs, scratch);
  if (y_bf16) run_all(M, K, segs, num_segs, xv, bias, static_cast<uint16_t*>(y));
  else run_all(M, K, segs, num_segs, xv, bias, static_cast<float*>(y));
}

void quant_linear_rows(const void* x, bool x_bf16, int64_t R, int64_t K, const SegmentView* segs, const int64_t* first,
                       void* y, bool y_bf16, void* scratch) {
  if (R <= 0) return;
  // each row runs alone (rows_of_group(1, ...)), never on the 8-bit panel
  const XView xv = quantize_rows(x, x_bf16, R, K, segs + first[0], first[R] - first[0], scratch);
  if (y_bf16) run_rows(R, K, segs, first, xv, static_cast<uint16_t*>(y));
  else run_rows(R, K, segs, first, xv, static_cast<float*>(y));
}

void quant_embedding(const int64_t* ids, int64_t T, const SegmentView* segs, int64_t num_segs, int64_t K, float* out) {
  const int64_t KB = K / kBlock;
#pragma omp parallel for schedule(static) if (T * K >= (1 << 16))
  for (int64_t t = 0; t < T; ++t) {
    int64_t n = ids[t];
    int64_t si = 0;
    while (si + 1 < num_segs && n >= segs[si].groups * kGroup) n -= segs[si++].groups * kGroup;
    const SegmentView& s = segs[si];
    const int64_t g = n / kGroup, c = n % kGroup;
    const int bits = format_bits(s.format);
    const int64_t bytes = bits * kGroup * kBlock / 8;
    const bool k_quant = format_is_k_quant(s.format);
    const int64_t param_blocks = k_quant ? K / kSuper : s.per_channel ? 1 : KB;
    const float offset = s.format == kFormatQ8 ? 128.f : s.format == kFormatQ4 ? 8.f : s.format == kFormatQ6K ? 32.f : 0.f;
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* codes = s.codes + (g * KB + b) * bytes;
      const int64_t pb = k_quant ? b * kBlock / kSuper : s.per_channel ? 0 : b;
      float d = simd::f16_to_f32(s.scales[(g * param_blocks + pb) * kGroup + c]);
      float m = s.mins ? simd::f16_to_f32(s.mins[(g * param_blocks + pb) * kGroup + c]) : -offset * d;
      const uint8_t* sub = k_quant ? s.sub + (g * KB + b) * 2 * kGroup : nullptr;
      if (s.format == kFormatQ4K) {  // d·sc, −dmin·mn: exact in fp32, as the kernel takes them
        d *= static_cast<float>(sub[c]);
        m = -(m * static_cast<float>(sub[kGroup + c]));
      }
      float* row = out + t * K + b * kBlock;
      // d·c is exact in fp32 (an 11-bit fp16 mantissa times an 8-bit code): one rounding, as the reference
      if (bits == 8) {
        for (int k = 0; k < kBlock; ++k) row[k] = d * static_cast<float>(codes[(k / 4) * 64 + c * 4 + k % 4]) + m;
      } else if (bits == 6) {  // w = d·sc_h·(c − 32), sc_h the scale of the input's half
        const float d_lo = d * static_cast<float>(static_cast<int8_t>(sub[c]));
        const float d_hi = d * static_cast<float>(static_cast<int8_t>(sub[kGroup + c]));
        for (int k = 0; k < 16; ++k) {
          const int j = k / 4, i = (j / 2) * 64 + c * 4 + k % 4, shift = 4 * (j % 2);
          const uint8_t byte = codes[j * 64 + c * 4 + k % 4], top = codes[256 + i] >> shift;
          row[k] = d_lo * static_cast<float>(((byte & 0x0f) | (top & 0x03) << 4) - 32);
          row[k + 16] = d_hi * static_cast<float>(((byte >> 4) | ((top >> 2) & 0x03) << 4) - 32);
        }
      } else {
        for (int k = 0; k < 16; ++k) {
          const uint8_t byte = codes[(k / 4) * 64 + c * 4 + k % 4];
          row[k] = d * static_cast<float>(byte & 0x0f) + m;
          row[k + 16] = d * static_cast<float>(byte >> 4) + m;
        }
      }
    }
  }
}

}  // namespace quant
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
