// Vector helpers shared by the kernels (every .cpp here but linear, fused_decode and bindings):
// bf16 ↔ fp32 for 16 lanes, e^x for softmax and SiLU, and SiLU·up.
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace {

inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline void store16(at::BFloat16* p, __m512 v) {
  // round to nearest even, as torch does
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// v rounded to bf16 as store16 rounds it, kept in fp32 lanes: store16 then load16 without
// the trip through memory.
inline __m512 round_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline at::BFloat16 to_bf16(float f) { return at::BFloat16(f); }

// e^x for 16 lanes: 2^(x·log2 e) split into an integer power (scalef) and a degree-6
// polynomial on the fraction; relative error ~1e-7, far below bf16's and the softmax's needs.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// SiLU·up as the reference computes it in bf16: silu(gate) rounded to bf16, times up (the
// caller rounds the product). gate and up are bf16 values held in fp32 lanes. x / (1 + e^-x)
// with a reciprocal estimate and one Newton step (~1e-7 relative; VDIVPS issues only every
// ~10 cycles); e^-x capped at e^80 so the reciprocal of an overflowed inf never meets 0·inf.
inline __m512 silu_mul16(__m512 gate, __m512 up, bool round_silu) {
  const __m512 neg = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gate), _mm512_set1_ps(80.f));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(neg));
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
  __m512 silu = _mm512_mul_ps(gate, r);
  if (round_silu) silu = round_bf16(silu);
  return _mm512_mul_ps(silu, up);
}

}  // namespace
