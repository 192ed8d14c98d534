// The vector vocabulary of the torch-free kernel core (kvserve/kernels/core), for the level
// being compiled. Each core source is compiled once per level with that level's flags
// (kvserve/kernels/build.py) and wraps its code in `namespace kvserve::KVSERVE_LEVEL_NS`, so
// several levels' objects can live in one process or one test binary.
//
// Levels and what this header maps to:
//   avx2          x86-64-v3: 8 fp32 lanes (__m256), int8 dots by VPMADDUBSW + VPMADDWD
//   avx512-vnni   the same 8-lane code, EVEX-encoded; int8 dots by VPDPBUSD on ymm
//   avx512-bf16   + bf16 pair dots by VDPBF16PS on ymm (kBf16Dot)
//   amx           + AMX tiles, for the one family only that level has (core/amx/: amx_linear)
//   neon          aarch64: the same 8-lane code on pairs of 128-bit NEON registers, through
//                 core/neon/x86_vocabulary.h (the x86 intrinsics below, written in NEON)
//   neon-dotprod  + int8 dots by SDOT (kVnniDot)
//   neon-i8mm     + int8 dots by USDOT, VPDPBUSD's own arithmetic (kVnniDot)
// A core source uses only what is here plus the __m256/__m256i intrinsics of AVX2/FMA/F16C,
// so it compiles at every level, x86 or ARM. Where a level has an instruction that changes
// how a kernel is best blocked (a bf16 pair dot needs no widening, so its tiles differ), the
// kernel asks this header's constexpr flags (kBf16Dot, kVnniDot) and keeps both tile shapes
// in its one source. The ARM levels keep kBf16Dot off: BFDOT/BFMMLA round their products
// differently from VDPBF16PS and from the widening path (round-to-odd, flushed denormals, by
// implementation), and the widening path is exact; what BFDOT would gain is not measured.
//
// bf16 values are raw uint16_t (the top half of an fp32); rounding to bf16 is to nearest even,
// as torch rounds.
#pragma once
#if defined(__aarch64__)
#include <arm_neon.h>

#include "neon/x86_vocabulary.h"
#else
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

#ifndef KVSERVE_LEVEL_NS
#error "compile the kernel core with -DKVSERVE_LEVEL_NS=<level> (kvserve/kernels/build.py does)"
#endif

#if !defined(__aarch64__) && (!defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__))
#error "the kernel core's x86 levels need AVX2, FMA and F16C (-march=x86-64-v3 or above)"
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVSERVE_VNNI_DOT 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define KVSERVE_VNNI_DOT 1  // dot4_u8s8 exact for all bytes: USDOT, or SDOT with a correction
#else
#define KVSERVE_VNNI_DOT 0
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define KVSERVE_BF16_DOT 1
#else
#define KVSERVE_BF16_DOT 0
#endif

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace simd {

constexpr int kLanes = 8;  // fp32 lanes of one vector
constexpr bool kVnniDot = KVSERVE_VNNI_DOT;  // dot4_u8s8 is one dot instruction (exact for all bytes)
constexpr bool kBf16Dot = KVSERVE_BF16_DOT;  // dot2_bf16 is one VDPBF16PS
#if defined(__AVX512VL__)
constexpr int kVecRegs = 32;  // ymm0-31 with EVEX
#else
constexpr int kVecRegs = 16;  // ymm0-15; on aarch64 v0-31 hold 16 values of 8 lanes
#endif

// ---- scalars ------------------------------------------------------------------------------

inline float bf16_to_f32(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

// ---- 8 fp32 lanes -------------------------------------------------------------------------

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bf16 widened
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
// 8 fp16 (the quantized formats' scales) widened
inline __m256 load8_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// v's lanes rounded to bf16 (nearest even), kept in fp32 lanes. NaN inputs are not expected.
inline __m256 round_bf16(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline void store8(uint16_t* p, __m256 v) {
  __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
  // 8 × 32-bit (each < 65536) → 8 × 16-bit: packus within 128-bit lanes, then fix the order
  __m128i lo = _mm256_castsi256_si128(bits), hi = _mm256_extracti128_si256(bits, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo, hi));
}

// Σ of 8 lanes in a fixed order ((0+4)+(2+6))+((1+5)+(3+7)): the same whatever the caller
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for 8 lanes: 2^(x·log2 e) as an integer power (built in the exponent bits) times a
// degree-6 polynomial on the fraction; relative error ~1e-7. x below -87 gives ~0.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  // 2^n: n in [-126, 127] after the clamps above, added into the exponent field
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Gemma 2's attention-logit soft-capping, cap·tanh(s/cap) for 8 lanes (inv_cap = 1/cap), with
// tanh(y) = 1 − 2/(e^(2y) + 1): exp8's clamps keep it finite (±1 at the ends, never NaN), and the
// division is exact at every level (an estimate would differ between x86 and ARM). Near 0 the
// subtraction leaves an absolute error of ~1e-7 in tanh, ~cap·1e-7 in the score.
inline __m256 softcap8(__m256 s, __m256 cap, __m256 inv_cap) {
  const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(2.f), _mm256_mul_ps(s, inv_cap)));
  const __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.f), _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, _mm256_set1_ps(1.f))));
  return _mm256_mul_ps(cap, t);
}

// silu(x) = x / (1 + e^-x) for 8 lanes, with a reciprocal estimate and one Newton step
// (~1e-7 relative; VDIVPS issues only every few cycles); e^-x capped at e^80 so the
// reciprocal of an overflow never meets 0·inf
inline __m256 silu8(__m256 x) {
  const __m256 neg = _mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), _mm256_set1_ps(80.f));
  const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.f), exp8(neg));
  __m256 r = _mm256_rcp_ps(d);
  r = _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.f)));
  return _mm256_mul_ps(x, r);
}

// ---- int8 dot products --------------------------------------------------------------------

#if defined(__aarch64__) && KVSERVE_VNNI_DOT
// The ARM dot levels' 4-way int8 dots on one 128-bit half: acc[i] += Σ_{t<4} u[4i+t]·s[4i+t].
namespace neon_dot {
// x86_vocabulary.h's __m128i is an int64x2_t and its __m256i the pair {lo, hi}
inline int8x16_t s8(__m128i v) { return vreinterpretq_s8_s64(v); }
inline int32x4_t s32(__m128i v) { return vreinterpretq_s32_s64(v); }
inline __m256i join(int32x4_t lo, int32x4_t hi) { return __m256i{vreinterpretq_s64_s32(lo), vreinterpretq_s64_s32(hi)}; }
// u any byte. i8mm: USDOT is this sum. dotprod: SDOT on u − 128 (u with its top bit flipped,
// read as signed) plus 128·Σs, itself an SDOT against ones: both exact in int32.
inline int32x4_t u8s8(int32x4_t acc, int8x16_t u, int8x16_t s) {
#if defined(__ARM_FEATURE_MATMUL_INT8)
  return vusdotq_s32(acc, vreinterpretq_u8_s8(u), s);
#else
  const int8x16_t centred = veorq_s8(u, vdupq_n_s8(static_cast<int8_t>(0x80)));
  const int32x4_t sums = vdotq_s32(vdupq_n_s32(0), vdupq_n_s8(1), s);
  return vaddq_s32(vdotq_s32(acc, centred, s), vshlq_n_s32(sums, 7));
#endif
}
// u below 128: the same bytes read as signed, one SDOT
inline int32x4_t u7s8(int32x4_t acc, int8x16_t u, int8x16_t s) { return vdotq_s32(acc, u, s); }
}  // namespace neon_dot
#endif

// acc[i] += Σ_{t<4} u[4i+t]·s[4i+t] for 8 int32 lanes, u unsigned and s signed bytes.
// At avx2 and neon the pairwise products go through int16 (VPMADDUBSW), which saturates past
// 32767: exact only while u·s pairs stay below that, e.g. u <= 127 (a sign moved onto s, as
// llama.cpp does) or u <= 15 (4-bit codes). At avx512-vnni (VPDPBUSD) and the ARM dot levels it
// is exact for all.
inline __m256i dot4_u8s8(__m256i acc, __m256i u, __m256i s) {
#if KVSERVE_VNNI_DOT && defined(__aarch64__)
  using namespace neon_dot;
  return join(u8s8(s32(_mm256_castsi256_si128(acc)), s8(_mm256_castsi256_si128(u)), s8(_mm256_castsi256_si128(s))),
              u8s8(s32(_mm256_extracti128_si256(acc, 1)), s8(_mm256_extracti128_si256(u, 1)),
                   s8(_mm256_extracti128_si256(s, 1))));
#elif KVSERVE_VNNI_DOT
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// dot4_u8s8 where every u is below 128 (the 4- and 6-bit codes): the same sums, and at
// neon-dotprod one SDOT instead of two (u read as signed is u).
inline __m256i dot4_u7s8(__m256i acc, __m256i u, __m256i s) {
#if KVSERVE_VNNI_DOT && defined(__aarch64__) && !defined(__ARM_FEATURE_MATMUL_INT8)
  using namespace neon_dot;
  return join(u7s8(s32(_mm256_castsi256_si128(acc)), s8(_mm256_castsi256_si128(u)), s8(_mm256_castsi256_si128(s))),
              u7s8(s32(_mm256_extracti128_si256(acc, 1)), s8(_mm256_extracti128_si256(u, 1)),
                   s8(_mm256_extracti128_si256(s, 1))));
#else
  return dot4_u8s8(acc, u, s);
#endif
}

// ---- bf16 pair dot products ----------------------------------------------------------------

// acc[i] += a[2i]·b[2i] + a[2i+1]·b[2i+1] for 8 fp32 lanes, a and b 16 bf16 each (pairs in
// 32-bit lanes, the even element in the low half). At avx512-bf16 one VDPBF16PS (denormal
// inputs read as zero, as that instruction does); below it two FMAs on the widened halves,
// the odd products first, as VDPBF16PS orders them. Kernels call it only where kBf16Dot: below
// that level they keep x widened to fp32 once per call, which is cheaper than widening per use.
inline __m256 dot2_bf16(__m256 acc, __m256i a, __m256i b) {
#if KVSERVE_BF16_DOT
  return _mm256_dpbf16_ps(acc, (__m256bh)a, (__m256bh)b);
#else
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, hi)), _mm256_castsi256_ps(_mm256_and_si256(b, hi)), acc);
  return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), acc);
#endif
}

// the 32-bit lane at p (two bf16) in all 8 lanes
inline __m256i bcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

inline __m256i load16_bf16(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

}  // namespace simd
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
