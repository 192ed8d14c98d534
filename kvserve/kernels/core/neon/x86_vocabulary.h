// The x86 vector vocabulary of the kernel core (kvserve/kernels/core), implemented in AArch64
// NEON, so the core's sources -- written with AVX2/FMA/F16C intrinsics -- compile unchanged
// for ARM: on aarch64 simd.h includes this header instead of <immintrin.h>.
//
// Only the names the core uses are here (plus the whole of _mm256_cmp_ps's predicate set and
// _mm256_round_ps's rounding modes, which cost a line each). Each is lane-for-lane and
// bit-for-bit what Intel's intrinsics guide specifies -- per-128-bit-lane behaviour of unpack,
// hadd, shuffle and packs, saturation, x86's NaN/zero rule of max/min, INT32_MIN for
// out-of-range conversions, zeroing bits of permute2x128 -- with two exceptions:
//   * _mm256_rcp_ps is the exact IEEE 1/x (VRCPPS is a ~12-bit estimate whose bits are
//     Intel's table, not reproducible; the core refines it by Newton steps, which converge
//     to the same result from an exact start). Also, VRCPPS reads denormal inputs as 0 (±inf
//     out) and gives 0 for |x| >= 2^126, where 1/x here is finite / 2^-126 or a denormal.
//   * a NaN produced by arithmetic may carry another sign/payload than on x86 (x86's default
//     NaN is 0xffc00000, ARM's 0x7fc00000; they pick among NaN operands differently).
//     Results are NaN in the same lanes. Moves, blends, max/min and compares are exact.
// tests/kernels/test_x86_vocabulary_neon.py checks all of it against real x86.
//
// 256-bit values are two 128-bit NEON registers (lo = x86 lanes 0-3 / bytes 0-15). AVX2's
// integer and most fp256 operations work within 128-bit lanes anyway, so each is the 128-bit
// operation on both halves; the cross-lane ones (permute*, extract) pick halves. Baseline
// ARMv8.0-A only (runs on a Cortex-A53): no dotprod, i8mm or fp16 arithmetic. Immediate
// operands are `int` parameters; the core passes constants, which fold once inlined.
#pragma once
#if !defined(__aarch64__)
#error "x86_vocabulary.h maps x86 intrinsics onto AArch64 NEON; on x86 include <immintrin.h>"
#endif
#include <arm_neon.h>

#include <cstdint>

typedef float32x4_t __m128;
typedef int64x2_t __m128i;
struct __m256 {
  float32x4_t lo, hi;
};
struct __m256i {
  int64x2_t lo, hi;
};

#define _MM_SHUFFLE(z, y, x, w) (((z) << 6) | ((y) << 4) | ((x) << 2) | (w))
#define _MM_HINT_NTA 0
#define _MM_HINT_T2 1
#define _MM_HINT_T1 2
#define _MM_HINT_T0 3
#define _MM_FROUND_TO_NEAREST_INT 0x00
#define _MM_FROUND_TO_NEG_INF 0x01
#define _MM_FROUND_TO_POS_INF 0x02
#define _MM_FROUND_TO_ZERO 0x03
#define _MM_FROUND_CUR_DIRECTION 0x04
#define _MM_FROUND_NO_EXC 0x08
// _mm256_cmp_ps predicates: bit 4 only chooses signalling vs quiet, which without FP
// exceptions changes nothing, so the low 4 bits select the comparison
#define _CMP_EQ_OQ 0x00
#define _CMP_LT_OS 0x01
#define _CMP_LE_OS 0x02
#define _CMP_UNORD_Q 0x03
#define _CMP_NEQ_UQ 0x04
#define _CMP_NLT_US 0x05
#define _CMP_NLE_US 0x06
#define _CMP_ORD_Q 0x07
#define _CMP_EQ_UQ 0x08
#define _CMP_NGE_US 0x09
#define _CMP_NGT_US 0x0a
#define _CMP_FALSE_OQ 0x0b
#define _CMP_NEQ_OQ 0x0c
#define _CMP_GE_OS 0x0d
#define _CMP_GT_OS 0x0e
#define _CMP_TRUE_UQ 0x0f
#define _CMP_EQ_OS 0x10
#define _CMP_LT_OQ 0x11
#define _CMP_LE_OQ 0x12
#define _CMP_UNORD_S 0x13
#define _CMP_NEQ_US 0x14
#define _CMP_NLT_UQ 0x15
#define _CMP_NLE_UQ 0x16
#define _CMP_ORD_S 0x17
#define _CMP_EQ_US 0x18
#define _CMP_NGE_UQ 0x19
#define _CMP_NGT_UQ 0x1a
#define _CMP_FALSE_OS 0x1b
#define _CMP_NEQ_OS 0x1c
#define _CMP_GE_OQ 0x1d
#define _CMP_GT_OQ 0x1e
#define _CMP_TRUE_US 0x1f

namespace x86v {  // helpers, not x86 names
// __m128i is kept as int64x2_t; these view it as the element type an operation needs (free)
static inline int8x16_t s8(__m128i a) { return vreinterpretq_s8_s64(a); }
static inline uint8x16_t u8(__m128i a) { return vreinterpretq_u8_s64(a); }
static inline int16x8_t s16(__m128i a) { return vreinterpretq_s16_s64(a); }
static inline uint16x8_t u16(__m128i a) { return vreinterpretq_u16_s64(a); }
static inline int32x4_t s32(__m128i a) { return vreinterpretq_s32_s64(a); }
static inline uint32x4_t u32(__m128i a) { return vreinterpretq_u32_s64(a); }
static inline __m128i m(int8x16_t a) { return vreinterpretq_s64_s8(a); }
static inline __m128i m(uint8x16_t a) { return vreinterpretq_s64_u8(a); }
static inline __m128i m(int16x8_t a) { return vreinterpretq_s64_s16(a); }
static inline __m128i m(uint16x8_t a) { return vreinterpretq_s64_u16(a); }
static inline __m128i m(int32x4_t a) { return vreinterpretq_s64_s32(a); }
static inline __m128i m(uint32x4_t a) { return vreinterpretq_s64_u32(a); }
static inline __m128i m(uint64x2_t a) { return vreinterpretq_s64_u64(a); }
static inline __m128i m(int64x2_t a) { return a; }
static inline __m128i m(float32x4_t a) { return vreinterpretq_s64_f32(a); }
static inline float32x4_t f(__m128i a) { return vreinterpretq_f32_s64(a); }

// byte indices for TBL that move 32-bit element sel[i] (0-3, +off for a second table
// register) into element i: each element's 4 bytes are sel*4 + {0,1,2,3}
static inline uint8x16_t idx32(int s0, int s1, int s2, int s3) {
  const uint64_t b = 0x0302010003020100ull;
  const uint64_t lo = b + 0x04040404ull * unsigned(s0) + (0x04040404ull * unsigned(s1) << 32);
  const uint64_t hi = b + 0x04040404ull * unsigned(s2) + (0x04040404ull * unsigned(s3) << 32);
  return vcombine_u8(vcreate_u8(lo), vcreate_u8(hi));
}
// shifts: x86 gives 0 for counts >= the element width; USHL does too for counts up to 127,
// so clamp to the width (NEON's vshlq_n needs a constant, vshlq takes a count vector; a
// negative count shifts right)
static inline int clamp_count(int n, int width) { return unsigned(n) > unsigned(width) ? width : n; }
// x86 max/min: a > b ? a : b and a < b ? a : b -- b when either is NaN or both are ±0
// (FMAX/FMIN would propagate the NaN and order the zeros)
static inline float32x4_t max(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
static inline float32x4_t min(float32x4_t a, float32x4_t b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
static inline __m128i sel128(__m256i a, __m256i b, int s) {  // permute2x128's half selector
  if (s & 8) return vdupq_n_s64(0);
  switch (s & 3) {
    case 0: return a.lo;
    case 1: return a.hi;
    case 2: return b.lo;
    default: return b.hi;
  }
}
static inline float32x4_t sel128(__m256 a, __m256 b, int s) {
  return f(sel128(__m256i{m(a.lo), m(a.hi)}, __m256i{m(b.lo), m(b.hi)}, s));
}
}  // namespace x86v

// an x86 operation that works on each 128-bit lane: the 128-bit body `expr` (of x, y) on both halves
#define X86V_EACH_I(name, expr)                                   \
  static inline __m256i name(__m256i a, __m256i b) {              \
    auto op = [](__m128i x, __m128i y) { return x86v::m(expr); }; \
    return __m256i{op(a.lo, b.lo), op(a.hi, b.hi)};               \
  }
#define X86V_EACH_F(name, expr)                                              \
  static inline __m256 name(__m256 a, __m256 b) {                            \
    auto op = [](float32x4_t x, float32x4_t y) -> float32x4_t { return expr; }; \
    return __m256{op(a.lo, b.lo), op(a.hi, b.hi)};                           \
  }
#define X86V_128_I(name, expr) \
  static inline __m128i name(__m128i x, __m128i y) { return x86v::m(expr); }

// ---- loads, stores, sets, casts ------------------------------------------------------------
// through uint8_t (unsigned char may alias anything, as __m256i_u may on x86); NEON needs no
// alignment, so the aligned and unaligned forms are the same

static inline __m256 _mm256_loadu_ps(const float* p) { return __m256{vld1q_f32(p), vld1q_f32(p + 4)}; }
static inline __m256 _mm256_load_ps(const float* p) { return _mm256_loadu_ps(p); }
static inline void _mm256_storeu_ps(float* p, __m256 a) { vst1q_f32(p, a.lo), vst1q_f32(p + 4, a.hi); }
static inline void _mm256_store_ps(float* p, __m256 a) { _mm256_storeu_ps(p, a); }
static inline __m256i _mm256_loadu_si256(const __m256i* p) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(p);
  return __m256i{x86v::m(vld1q_u8(b)), x86v::m(vld1q_u8(b + 16))};
}
static inline __m256i _mm256_load_si256(const __m256i* p) { return _mm256_loadu_si256(p); }
static inline void _mm256_storeu_si256(__m256i* p, __m256i a) {
  uint8_t* b = reinterpret_cast<uint8_t*>(p);
  vst1q_u8(b, x86v::u8(a.lo)), vst1q_u8(b + 16, x86v::u8(a.hi));
}
static inline void _mm256_store_si256(__m256i* p, __m256i a) { _mm256_storeu_si256(p, a); }
static inline __m256 _mm256_broadcast_ss(const float* p) { return __m256{vld1q_dup_f32(p), vld1q_dup_f32(p)}; }
static inline __m128 _mm_loadu_ps(const float* p) { return vld1q_f32(p); }
static inline void _mm_storeu_ps(float* p, __m128 a) { vst1q_f32(p, a); }
static inline __m128i _mm_loadu_si128(const __m128i* p) { return x86v::m(vld1q_u8(reinterpret_cast<const uint8_t*>(p))); }
static inline void _mm_storeu_si128(__m128i* p, __m128i a) { vst1q_u8(reinterpret_cast<uint8_t*>(p), x86v::u8(a)); }
static inline void _mm_store_si128(__m128i* p, __m128i a) { _mm_storeu_si128(p, a); }
static inline __m128i _mm_loadl_epi64(const __m128i* p) {  // low 8 bytes, upper 8 zeroed
  return x86v::m(vcombine_u8(vld1_u8(reinterpret_cast<const uint8_t*>(p)), vdup_n_u8(0)));
}
static inline void _mm_storel_epi64(__m128i* p, __m128i a) { vst1_u8(reinterpret_cast<uint8_t*>(p), vget_low_u8(x86v::u8(a))); }
// the locality hint is dropped: prefetch for read into all cache levels
static inline void _mm_prefetch(const void* p, int) { __builtin_prefetch(p, 0, 3); }

static inline __m256 _mm256_set1_ps(float v) { return __m256{vdupq_n_f32(v), vdupq_n_f32(v)}; }
static inline __m256 _mm256_setzero_ps() { return _mm256_set1_ps(0.f); }
static inline __m256i _mm256_set1_epi8(char v) { return __m256i{x86v::m(vdupq_n_s8(v)), x86v::m(vdupq_n_s8(v))}; }
static inline __m256i _mm256_set1_epi16(short v) { return __m256i{x86v::m(vdupq_n_s16(v)), x86v::m(vdupq_n_s16(v))}; }
static inline __m256i _mm256_set1_epi32(int v) { return __m256i{x86v::m(vdupq_n_s32(v)), x86v::m(vdupq_n_s32(v))}; }
static inline __m256i _mm256_setzero_si256() { return _mm256_set1_epi32(0); }
static inline __m256i _mm256_setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7) {
  const int32_t lo[4] = {e0, e1, e2, e3}, hi[4] = {e4, e5, e6, e7};
  return __m256i{x86v::m(vld1q_s32(lo)), x86v::m(vld1q_s32(hi))};
}

static inline __m256i _mm256_castps_si256(__m256 a) { return __m256i{x86v::m(a.lo), x86v::m(a.hi)}; }
static inline __m256 _mm256_castsi256_ps(__m256i a) { return __m256{x86v::f(a.lo), x86v::f(a.hi)}; }
static inline __m128 _mm256_castps256_ps128(__m256 a) { return a.lo; }
static inline __m128i _mm256_castsi256_si128(__m256i a) { return a.lo; }
static inline __m128 _mm256_extractf128_ps(__m256 a, int i) { return i & 1 ? a.hi : a.lo; }
static inline __m128i _mm256_extracti128_si256(__m256i a, int i) { return i & 1 ? a.hi : a.lo; }
static inline float _mm256_cvtss_f32(__m256 a) { return vgetq_lane_f32(a.lo, 0); }
static inline float _mm_cvtss_f32(__m128 a) { return vgetq_lane_f32(a, 0); }
static inline int _mm_cvtsi128_si32(__m128i a) { return vgetq_lane_s32(x86v::s32(a), 0); }

// ---- fp32 arithmetic -----------------------------------------------------------------------

X86V_EACH_F(_mm256_add_ps, vaddq_f32(x, y))
X86V_EACH_F(_mm256_sub_ps, vsubq_f32(x, y))
X86V_EACH_F(_mm256_mul_ps, vmulq_f32(x, y))
X86V_EACH_F(_mm256_div_ps, vdivq_f32(x, y))
X86V_EACH_F(_mm256_max_ps, x86v::max(x, y))
X86V_EACH_F(_mm256_min_ps, x86v::min(x, y))
X86V_EACH_F(_mm256_and_ps, vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x), vreinterpretq_u32_f32(y))))
X86V_EACH_F(_mm256_andnot_ps, vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(y), vreinterpretq_u32_f32(x))))  // ~x & y
// per 128-bit lane: a0+a1, a2+a3, b0+b1, b2+b3 -- exactly FADDP
X86V_EACH_F(_mm256_hadd_ps, vpaddq_f32(x, y))
// fused, one rounding: a·b+c, a·b-c (as a·b+(-c), so an exact zero is +0 as on x86), c-a·b
static inline __m256 _mm256_fmadd_ps(__m256 a, __m256 b, __m256 c) {
  return __m256{vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)};
}
static inline __m256 _mm256_fmsub_ps(__m256 a, __m256 b, __m256 c) {
  return __m256{vfmaq_f32(vnegq_f32(c.lo), a.lo, b.lo), vfmaq_f32(vnegq_f32(c.hi), a.hi, b.hi)};
}
static inline __m256 _mm256_fnmadd_ps(__m256 a, __m256 b, __m256 c) {
  return __m256{vfmsq_f32(c.lo, a.lo, b.lo), vfmsq_f32(c.hi, a.hi, b.hi)};
}
// exact 1/x, not VRCPPS's estimate (see the top of this file): FRECPE is an 8-bit estimate
// with other bits again, so no estimate here would match x86 either
static inline __m256 _mm256_rcp_ps(__m256 a) { return _mm256_div_ps(_mm256_set1_ps(1.f), a); }
static inline __m256 _mm256_round_ps(__m256 a, int mode) {
  auto op = [mode](float32x4_t x) {
    switch (mode & 7) {
      case _MM_FROUND_TO_NEAREST_INT: return vrndnq_f32(x);  // ties to even
      case _MM_FROUND_TO_NEG_INF: return vrndmq_f32(x);
      case _MM_FROUND_TO_POS_INF: return vrndpq_f32(x);
      case _MM_FROUND_TO_ZERO: return vrndq_f32(x);
      default: return vrndiq_f32(x);  // the current mode (FPCR, as MXCSR on x86)
    }
  };
  return __m256{op(a.lo), op(a.hi)};
}
static inline __m256 _mm256_blendv_ps(__m256 a, __m256 b, __m256 mask) {  // b where mask's sign bit is set
  auto op = [](float32x4_t x, float32x4_t y, float32x4_t k) {
    return vbslq_f32(vreinterpretq_u32_s32(vshrq_n_s32(vreinterpretq_s32_f32(k), 31)), y, x);
  };
  return __m256{op(a.lo, b.lo, mask.lo), op(a.hi, b.hi, mask.hi)};
}
// all ones where the predicate holds; the ordered ones are false and the unordered true for NaN
static inline __m256 _mm256_cmp_ps(__m256 a, __m256 b, int pred) {
  auto op = [pred](float32x4_t x, float32x4_t y) {
    const uint32x4_t ord = vandq_u32(vceqq_f32(x, x), vceqq_f32(y, y));
    uint32x4_t r;
    switch (pred & 15) {
      case _CMP_EQ_OQ: r = vceqq_f32(x, y); break;
      case _CMP_LT_OS: r = vcltq_f32(x, y); break;
      case _CMP_LE_OS: r = vcleq_f32(x, y); break;
      case _CMP_UNORD_Q: r = vmvnq_u32(ord); break;
      case _CMP_NEQ_UQ: r = vmvnq_u32(vceqq_f32(x, y)); break;
      case _CMP_NLT_US: r = vmvnq_u32(vcltq_f32(x, y)); break;
      case _CMP_NLE_US: r = vmvnq_u32(vcleq_f32(x, y)); break;
      case _CMP_ORD_Q: r = ord; break;
      case _CMP_EQ_UQ: r = vornq_u32(vceqq_f32(x, y), ord); break;
      case _CMP_NGE_US: r = vmvnq_u32(vcgeq_f32(x, y)); break;
      case _CMP_NGT_US: r = vmvnq_u32(vcgtq_f32(x, y)); break;
      case _CMP_FALSE_OQ: r = vdupq_n_u32(0); break;
      case _CMP_NEQ_OQ: r = vbicq_u32(ord, vceqq_f32(x, y)); break;
      case _CMP_GE_OS: r = vcgeq_f32(x, y); break;
      case _CMP_GT_OS: r = vcgtq_f32(x, y); break;
      default: r = vdupq_n_u32(~0u); break;  // _CMP_TRUE_UQ
    }
    return vreinterpretq_f32_u32(r);
  };
  return __m256{op(a.lo, b.lo), op(a.hi, b.hi)};
}
// per 128-bit lane: a[imm0], a[imm1], b[imm2], b[imm3] (2 bits each), by TBL over {a, b}
static inline __m256 _mm256_shuffle_ps(__m256 a, __m256 b, int imm) {
  const uint8x16_t i = x86v::idx32(imm & 3, imm >> 2 & 3, (imm >> 4 & 3) + 4, (imm >> 6 & 3) + 4);
  auto op = [i](float32x4_t x, float32x4_t y) {
    const uint8x16x2_t t = {{vreinterpretq_u8_f32(x), vreinterpretq_u8_f32(y)}};
    return vreinterpretq_f32_u8(vqtbl2q_u8(t, i));
  };
  return __m256{op(a.lo, b.lo), op(a.hi, b.hi)};
}
static inline __m256 _mm256_permute2f128_ps(__m256 a, __m256 b, int imm) {
  return __m256{x86v::sel128(a, b, imm), x86v::sel128(a, b, imm >> 4)};
}

static inline __m128 _mm_add_ps(__m128 a, __m128 b) { return vaddq_f32(a, b); }
static inline __m128 _mm_mul_ps(__m128 a, __m128 b) { return vmulq_f32(a, b); }
static inline __m128 _mm_max_ps(__m128 a, __m128 b) { return x86v::max(a, b); }
// lane 0 only, lanes 1-3 from a
static inline __m128 _mm_add_ss(__m128 a, __m128 b) { return vcopyq_laneq_f32(a, 0, vaddq_f32(a, b), 0); }
static inline __m128 _mm_max_ss(__m128 a, __m128 b) { return vcopyq_laneq_f32(a, 0, x86v::max(a, b), 0); }
static inline __m128 _mm_movehl_ps(__m128 a, __m128 b) { return vcombine_f32(vget_high_f32(b), vget_high_f32(a)); }  // b2 b3 a2 a3
static inline __m128 _mm_movehdup_ps(__m128 a) { return vtrn2q_f32(a, a); }  // a1 a1 a3 a3

// ---- conversions ---------------------------------------------------------------------------

static inline __m256 _mm256_cvtepi32_ps(__m256i a) {
  return __m256{vcvtq_f32_s32(x86v::s32(a.lo)), vcvtq_f32_s32(x86v::s32(a.hi))};
}
// nearest even; FCVTNS saturates (and gives 0 for NaN) where x86 gives INT32_MIN for every
// out-of-range or NaN lane: below -2^31 the two agree, the rest is fixed by one compare
static inline __m256i _mm256_cvtps_epi32(__m256 a) {
  auto op = [](float32x4_t x) {
    const uint32x4_t in_range = vcltq_f32(x, vdupq_n_f32(2147483648.f));  // false for NaN
    return x86v::m(vbslq_s32(in_range, vcvtnq_s32_f32(x), vdupq_n_s32(INT32_MIN)));
  };
  return __m256i{op(a.lo), op(a.hi)};
}
// fp16 -> fp32 is exact, so FCVTL gives x86's bits (denormals, inf and NaN included)
static inline __m256 _mm256_cvtph_ps(__m128i a) {
  const float16x8_t h = vreinterpretq_f16_s64(a);
  return __m256{vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
static inline float _cvtsh_ss(unsigned short h) { return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0); }
static inline __m256i _mm256_cvtepi8_epi16(__m128i a) {
  return __m256i{x86v::m(vmovl_s8(vget_low_s8(x86v::s8(a)))), x86v::m(vmovl_high_s8(x86v::s8(a)))};
}
static inline __m256i _mm256_cvtepi8_epi32(__m128i a) {  // the low 8 bytes
  const int16x8_t w = vmovl_s8(vget_low_s8(x86v::s8(a)));
  return __m256i{x86v::m(vmovl_s16(vget_low_s16(w))), x86v::m(vmovl_high_s16(w))};
}
static inline __m256i _mm256_cvtepu8_epi32(__m128i a) {
  const uint16x8_t w = vmovl_u8(vget_low_u8(x86v::u8(a)));
  return __m256i{x86v::m(vmovl_u16(vget_low_u16(w))), x86v::m(vmovl_high_u16(w))};
}
static inline __m256i _mm256_cvtepu16_epi32(__m128i a) {
  return __m256i{x86v::m(vmovl_u16(vget_low_u16(x86v::u16(a)))), x86v::m(vmovl_high_u16(x86v::u16(a)))};
}

// ---- integer -------------------------------------------------------------------------------

X86V_EACH_I(_mm256_add_epi16, vaddq_s16(x86v::s16(x), x86v::s16(y)))
X86V_EACH_I(_mm256_add_epi32, vaddq_s32(x86v::s32(x), x86v::s32(y)))
X86V_EACH_I(_mm256_sub_epi32, vsubq_s32(x86v::s32(x), x86v::s32(y)))
X86V_EACH_I(_mm256_mullo_epi32, vmulq_s32(x86v::s32(x), x86v::s32(y)))  // low 32 bits of the product
X86V_EACH_I(_mm256_cmpgt_epi32, vcgtq_s32(x86v::s32(x), x86v::s32(y)))
X86V_EACH_I(_mm256_and_si256, vandq_s64(x, y))
X86V_EACH_I(_mm256_or_si256, vorrq_s64(x, y))
X86V_EACH_I(_mm256_xor_si256, veorq_s64(x, y))
// a where b > 0, -a (wrapping: -(-128) = -128) where b < 0, 0 where b == 0
X86V_EACH_I(_mm256_sign_epi8, vandq_s8(vbslq_s8(vcltzq_s8(x86v::s8(y)), vnegq_s8(x86v::s8(x)), x86v::s8(x)),
                                       vreinterpretq_s8_u8(vtstq_s8(x86v::s8(y), x86v::s8(y)))))
// int16 pairs: a0·b0 + a1·b1 in int32 (wrapping only for all four -32768, as on x86)
X86V_EACH_I(_mm256_madd_epi16, vpaddq_s32(vmull_s16(vget_low_s16(x86v::s16(x)), vget_low_s16(x86v::s16(y))),
                                          vmull_high_s16(x86v::s16(x), x86v::s16(y))))
// unsigned bytes of a times signed bytes of b, adjacent pairs summed with int16 saturation
// (each product fits int16 exactly; only the pair sum can saturate)
X86V_EACH_I(_mm256_maddubs_epi16,
            [](int16x8_t p0, int16x8_t p1) { return vqaddq_s16(vuzp1q_s16(p0, p1), vuzp2q_s16(p0, p1)); }(
                vmulq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(x86v::u8(x)))), vmovl_s8(vget_low_s8(x86v::s8(y)))),
                vmulq_s16(vreinterpretq_s16_u16(vmovl_high_u8(x86v::u8(x))), vmovl_high_s8(x86v::s8(y)))))
// per 128-bit lane: a's 8 (4) elements saturated, then b's
X86V_EACH_I(_mm256_packs_epi16, vcombine_s8(vqmovn_s16(x86v::s16(x)), vqmovn_s16(x86v::s16(y))))
X86V_EACH_I(_mm256_packs_epi32, vcombine_s16(vqmovn_s32(x86v::s32(x)), vqmovn_s32(x86v::s32(y))))
// per 128-bit lane: lo interleaves the low halves, hi the high halves
X86V_EACH_I(_mm256_unpacklo_epi16, vzip1q_s16(x86v::s16(x), x86v::s16(y)))
X86V_EACH_I(_mm256_unpackhi_epi16, vzip2q_s16(x86v::s16(x), x86v::s16(y)))
X86V_EACH_I(_mm256_unpacklo_epi32, vzip1q_s32(x86v::s32(x), x86v::s32(y)))
X86V_EACH_I(_mm256_unpackhi_epi32, vzip2q_s32(x86v::s32(x), x86v::s32(y)))
X86V_EACH_I(_mm256_unpacklo_epi64, vzip1q_s64(x, y))
X86V_EACH_I(_mm256_unpackhi_epi64, vzip2q_s64(x, y))
X86V_128_I(_mm_add_epi32, vaddq_s32(x86v::s32(x), x86v::s32(y)))
X86V_128_I(_mm_packs_epi16, vcombine_s8(vqmovn_s16(x86v::s16(x)), vqmovn_s16(x86v::s16(y))))
X86V_128_I(_mm_packs_epi32, vcombine_s16(vqmovn_s32(x86v::s32(x)), vqmovn_s32(x86v::s32(y))))
X86V_128_I(_mm_packus_epi32, vcombine_u16(vqmovun_s32(x86v::s32(x)), vqmovun_s32(x86v::s32(y))))  // int32 -> uint16
X86V_128_I(_mm_unpacklo_epi16, vzip1q_s16(x86v::s16(x), x86v::s16(y)))
X86V_128_I(_mm_unpackhi_epi16, vzip2q_s16(x86v::s16(x), x86v::s16(y)))
X86V_128_I(_mm_unpacklo_epi32, vzip1q_s32(x86v::s32(x), x86v::s32(y)))
X86V_128_I(_mm_unpackhi_epi32, vzip2q_s32(x86v::s32(x), x86v::s32(y)))
X86V_128_I(_mm_unpacklo_epi64, vzip1q_s64(x, y))
X86V_128_I(_mm_unpackhi_epi64, vzip2q_s64(x, y))

static inline __m256i _mm256_abs_epi8(__m256i a) {  // |-128| = 0x80, as on x86
  return __m256i{x86v::m(vabsq_s8(x86v::s8(a.lo))), x86v::m(vabsq_s8(x86v::s8(a.hi)))};
}
static inline __m256i _mm256_blendv_epi8(__m256i a, __m256i b, __m256i mask) {  // b where a mask byte's top bit is set
  auto op = [](__m128i x, __m128i y, __m128i k) {
    return x86v::m(vbslq_s8(vreinterpretq_u8_s8(vshrq_n_s8(x86v::s8(k), 7)), x86v::s8(y), x86v::s8(x)));
  };
  return __m256i{op(a.lo, b.lo, mask.lo), op(a.hi, b.hi, mask.hi)};
}
// logical shifts by an immediate; counts past the width give 0
static inline __m256i _mm256_slli_epi16(__m256i a, int n) {
  const int16x8_t c = vdupq_n_s16(int16_t(x86v::clamp_count(n, 16)));
  return __m256i{x86v::m(vshlq_u16(x86v::u16(a.lo), c)), x86v::m(vshlq_u16(x86v::u16(a.hi), c))};
}
static inline __m256i _mm256_srli_epi16(__m256i a, int n) {
  const int16x8_t c = vdupq_n_s16(int16_t(-x86v::clamp_count(n, 16)));
  return __m256i{x86v::m(vshlq_u16(x86v::u16(a.lo), c)), x86v::m(vshlq_u16(x86v::u16(a.hi), c))};
}
static inline __m256i _mm256_slli_epi32(__m256i a, int n) {
  const int32x4_t c = vdupq_n_s32(x86v::clamp_count(n, 32));
  return __m256i{x86v::m(vshlq_u32(x86v::u32(a.lo), c)), x86v::m(vshlq_u32(x86v::u32(a.hi), c))};
}
static inline __m256i _mm256_srli_epi32(__m256i a, int n) {
  const int32x4_t c = vdupq_n_s32(-x86v::clamp_count(n, 32));
  return __m256i{x86v::m(vshlq_u32(x86v::u32(a.lo), c)), x86v::m(vshlq_u32(x86v::u32(a.hi), c))};
}
// dst element i = a[(imm >> 2i) & 3]
static inline __m128i _mm_shuffle_epi32(__m128i a, int imm) {
  return x86v::m(vqtbl1q_u8(x86v::u8(a), x86v::idx32(imm & 3, imm >> 2 & 3, imm >> 4 & 3, imm >> 6 & 3)));
}
// across the halves: dst 64-bit element i = a[(imm >> 2i) & 3], by TBL over both halves
static inline __m256i _mm256_permute4x64_epi64(__m256i a, int imm) {
  const uint8x16x2_t t = {{x86v::u8(a.lo), x86v::u8(a.hi)}};
  auto q = [imm](int i) { return vcreate_u8(0x0706050403020100ull + 0x0808080808080808ull * unsigned(imm >> 2 * i & 3)); };
  return __m256i{x86v::m(vqtbl2q_u8(t, vcombine_u8(q(0), q(1)))), x86v::m(vqtbl2q_u8(t, vcombine_u8(q(2), q(3))))};
}
// dst 32-bit element i = a[idx[i] & 7]: byte indices idx*4 + {0,1,2,3} into both halves
static inline __m256i _mm256_permutevar8x32_epi32(__m256i a, __m256i idx) {
  const uint8x16x2_t t = {{x86v::u8(a.lo), x86v::u8(a.hi)}};
  auto bytes = [](__m128i i) {
    return vreinterpretq_u8_u32(vmlaq_n_u32(vdupq_n_u32(0x03020100u), vandq_u32(x86v::u32(i), vdupq_n_u32(7)), 0x04040404u));
  };
  return __m256i{x86v::m(vqtbl2q_u8(t, bytes(idx.lo))), x86v::m(vqtbl2q_u8(t, bytes(idx.hi)))};
}
// each half of dst: a.lo, a.hi, b.lo or b.hi by imm bits 0-1 (4-5), zero if bit 3 (7) is set
static inline __m256i _mm256_permute2x128_si256(__m256i a, __m256i b, int imm) {
  return __m256i{x86v::sel128(a, b, imm), x86v::sel128(a, b, imm >> 4)};
}

#undef X86V_EACH_I
#undef X86V_EACH_F
#undef X86V_128_I
