// The norm_rope_act family's torch-free core (norm_rope_act.h): rms_norm, rope_and_cache
// (and its int8 KV form), silu_and_mul and gelu_tanh_and_mul, 8 fp32 lanes at a time.
//
// Layout and order: every function walks one token row at a time; the rows are independent
// and split across threads (OpenMP, static) only when the call is large enough to pay for it,
// the activations also splitting a row into column chunks (each output element is its own).
// Nothing sums across rows, and a row's only reduction (rms_norm's Σ x²) runs in 4 vector
// accumulators over the row's elements in order (element d in accumulator (d / 8) % 4, lane
// d % 8; the last < 32 elements through a zero-padded copy), then ((a0 + a1) + (a2 + a3)) and
// hsum8: fixed by D alone, so a row's bits never depend on the other rows of the call.
// The quantization maximum (rope_and_cache_int8) is a max, exact in any order.
#include "norm_rope_act.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace nra {
namespace {

using simd::load8;
using simd::store8;

template <typename T>
constexpr bool kBf16 = std::is_same_v<T, uint16_t>;

// n (< 8) elements into a zero-padded vector, and back: the tail of a row off the 8-lane grid
// takes the vector loop's exact operations
template <typename T>
inline __m256 load_tail(const T* p, int64_t n) {
  T buf[8] = {};
  for (int64_t i = 0; i < n; ++i) buf[i] = p[i];
  return load8(buf);
}
template <typename T>
inline void store_tail(T* p, __m256 v, int64_t n) {
  T buf[8];
  store8(buf, v);
  for (int64_t i = 0; i < n; ++i) p[i] = buf[i];
}
template <typename T>
inline __m256 load_n(const T* p, int64_t n) { return n >= 8 ? load8(p) : load_tail(p, n); }
template <typename T>
inline void store_n(T* p, __m256 v, int64_t n) {
  if (n >= 8) store8(p, v); else store_tail(p, v, n);
}

// v rounded to the dtype, kept in fp32 lanes (a no-op for fp32)
template <typename T>
inline __m256 to_dtype(__m256 v) {
  if constexpr (kBf16<T>) return simd::round_bf16(v); else return v;
}

// Whether a call of `work` elements is worth a parallel region (~ a few µs of fork/join).
inline bool parallel_worth(int64_t rows, int64_t work) { return rows > 1 && work >= (int64_t{1} << 15); }

// ---- rms_norm -----------------------------------------------------------------------------

// Σ v² of 32 values into the 4 accumulators (values 8k..8k+7 into acc k)
struct SumSq {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  inline void add32(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
    a2 = _mm256_fmadd_ps(v2, v2, a2);
    a3 = _mm256_fmadd_ps(v3, v3, a3);
  }
  inline float total() const { return simd::hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))); }
};

// residual[0, 32) += x[0, 32), rounded to the dtype as stored; the stored values' squares summed
template <typename T>
inline void add_residual32(T* res, const T* x, SumSq& ss) {
  const __m256 r0 = to_dtype<T>(_mm256_add_ps(load8(res), load8(x)));
  const __m256 r1 = to_dtype<T>(_mm256_add_ps(load8(res + 8), load8(x + 8)));
  const __m256 r2 = to_dtype<T>(_mm256_add_ps(load8(res + 16), load8(x + 16)));
  const __m256 r3 = to_dtype<T>(_mm256_add_ps(load8(res + 24), load8(x + 24)));
  store8(res, r0);
  store8(res + 8, r1);
  store8(res + 16, r2);
  store8(res + 24, r3);
  ss.add32(r0, r1, r2, r3);
}

// Σ x² of x[0, D) in SumSq's order: 32 at a time, the last < 32 values through a zero-padded
// copy (padding adds 0 to the sums)
template <typename T>
float sum_squares(const T* x, int64_t D) {
  SumSq ss;
  const int64_t D32 = D / 32 * 32;
  for (int64_t d = 0; d < D32; d += 32) ss.add32(load8(x + d), load8(x + d + 8), load8(x + d + 16), load8(x + d + 24));
  if (D > D32) {
    T xb[32] = {};
    std::copy(x + D32, x + D, xb);
    ss.add32(load8(xb), load8(xb + 8), load8(xb + 16), load8(xb + 24));
  }
  return ss.total();
}

// out[0, D) = (x · inv rounded to the dtype) · w rounded to the dtype
template <typename T>
void scale_row(const T* x, float inv_scalar, const T* w, T* out, int64_t D) {
  const __m256 inv = _mm256_set1_ps(inv_scalar);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) store8(out + d, _mm256_mul_ps(to_dtype<T>(_mm256_mul_ps(load8(x + d), inv)), load8(w + d)));
  if (d < D) {
    const int64_t n = D - d;
    store_tail(out + d, _mm256_mul_ps(to_dtype<T>(_mm256_mul_ps(load_tail(x + d, n), inv)), load_tail(w + d, n)), n);
  }
}

// 1 / sqrt(Σx² / width + eps), in fp32
inline float inv_rms(float sum_sq, float width, float eps) { return 1.f / std::sqrt(sum_sq / width + eps); }

template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, T* res, int64_t D, float eps) {
  float sum_sq;
  const T* src = x;
  if (res) {
    SumSq ss;
    const int64_t D32 = D / 32 * 32, tail = D - D32;
    for (int64_t d = 0; d < D32; d += 32) add_residual32(res + d, x + d, ss);
    if (tail) {  // the last < 32 values through zero-padded copies: padding adds 0 to the sums
      T rb[32] = {}, xb[32] = {};
      std::copy(res + D32, res + D, rb);
      std::copy(x + D32, x + D, xb);
      add_residual32(rb, xb, ss);
      std::copy(rb, rb + tail, res + D32);
    }
    sum_sq = ss.total();
    src = res;
  } else {
    sum_sq = sum_squares(x, D);
  }
  scale_row(src, inv_rms(sum_sq, static_cast<float>(D), eps), w, out, D);
}

template <typename T>
void rms_norm_impl(const T* x, const T* w, T* out, T* residual, int64_t T_, int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (parallel_worth(T_, T_ * D))
  for (int64_t t = 0; t < T_; ++t)
    rms_norm_row(x + t * D, w, out + t * D, residual ? residual + t * D : nullptr, D, eps);
}

// ---- q/k norms over the whole projections (OLMoE) --------------------------------------------

template <typename T>
void qk_sum_squares_impl(const T* qkv, float* sums, int64_t T_, int64_t q_size, int64_t kv_size) {
  const int64_t width = q_size + 2 * kv_size;
#pragma omp parallel for schedule(static) if (parallel_worth(T_, T_ * width))
  for (int64_t t = 0; t < T_; ++t) {
    const T* row = qkv + t * width;
    sums[2 * t] = sum_squares(row, q_size);
    sums[2 * t + 1] = sum_squares(row + q_size, kv_size);
  }
}

template <typename T>
void whole_projection_norm_impl(const WholeNormArgs<T>& a) {
  const int64_t width = a.q_size + 2 * a.kv_size;
#pragma omp parallel for schedule(static) if (parallel_worth(a.num_tokens, a.num_tokens * width))
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const T* row = a.qkv + t * width;
    T* out = a.out + t * width;
    const float sq = a.sums ? a.sums[2 * t] : sum_squares(row, a.q_size);
    const float sk = a.sums ? a.sums[2 * t + 1] : sum_squares(row + a.q_size, a.kv_size);
    scale_row(row, inv_rms(sq, a.q_width, a.eps), a.q_weight, out, a.q_size);
    scale_row(row + a.q_size, inv_rms(sk, a.k_width, a.eps), a.k_weight, out + a.q_size, a.kv_size);
    std::copy(row + a.q_size + a.kv_size, row + width, out + a.q_size + a.kv_size);
  }
}

// ---- RoPE ---------------------------------------------------------------------------------

// rotate-half of one head of H = 2·half values: out[i] = x[i]·c − x[i+half]·s,
// out[i+half] = x[i+half]·c + x[i]·s (one FMA each); returned through
// `emit(offset, lo, hi, n)` with lo, hi the rotated lanes [i, i+n) and [half+i, half+i+n)
template <typename T, typename Emit>
inline void rope_head(const T* src, const float* cos, const float* sin, int64_t half, Emit&& emit) {
  for (int64_t i = 0; i < half; i += 8) {
    const int64_t n = std::min<int64_t>(8, half - i);
    const __m256 a = load_n(src + i, n), b = load_n(src + half + i, n);
    const __m256 c = load_n(cos + i, n), s = load_n(sin + i, n);
    emit(i, _mm256_fnmadd_ps(b, s, _mm256_mul_ps(a, c)), _mm256_fmadd_ps(a, s, _mm256_mul_ps(b, c)), n);
  }
}

template <typename T>
inline void rope_store(const T* src, T* dst, const float* cos, const float* sin, int64_t half) {
  rope_head(src, cos, sin, half, [&](int64_t i, __m256 lo, __m256 hi, int64_t n) {
    store_n(dst + i, lo, n);
    store_n(dst + half + i, hi, n);
  });
}

template <typename T>
inline void copy_row(const T* src, T* dst, int64_t H) {
  std::copy(src, src + H, dst);
}

inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

// quantize_kv of one row of H values (fp32, or bf16 widened): see the header
template <typename S>
inline void quantize_row(const S* x, int64_t H, int8_t* dst, float* scale_out) {
  __m256 mx = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) mx = _mm256_max_ps(mx, abs8(load8(x + i)));
  if (i < H) mx = _mm256_max_ps(mx, abs8(load_tail(x + i, H - i)));
  const float scale = simd::hmax8(mx) / 127.f;  // a true division, as torch's
  *scale_out = scale;
  const __m256 div = _mm256_set1_ps(scale > 0.f ? scale : 1.f);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (i = 0; i < H; i += 8) {
    const int64_t n = std::min<int64_t>(8, H - i);
    const __m256 q = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(load_n(x + i, n), div), lo), hi);
    // round half to even (the default MXCSR mode, as torch.round), then 8 × int32 → int8
    const __m256i q32 = _mm256_cvtps_epi32(q);
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
    const __m128i q8 = _mm_packs_epi16(q16, q16);
    if (n == 8) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), q8);
    } else {
      alignas(16) int8_t buf[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(buf), q8);
      std::copy(buf, buf + n, dst + i);
    }
  }
}

template <typename T>
void rope_q(const RopeArgs<T>& a, int64_t t, const T* row, const float* c, const float* s) {
  const int64_t H = a.head_dim, half = H / 2;
  for (int64_t h = 0; h < a.num_heads; ++h) rope_store(row + h * H, a.q_out + (t * a.num_heads + h) * H, c, s, half);
}

template <typename T>
void rope_and_cache_impl(const RopeArgs<T>& a, T* k_pool, T* v_pool) {
  const int64_t H = a.head_dim, half = H / 2, nq = a.num_heads, nkv = a.num_kv_heads;
#pragma omp parallel for schedule(static) if (parallel_worth(a.num_tokens, a.num_tokens * (nq + 2 * nkv) * H * 4))
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const T* row = a.qkv + t * a.width;
    const float* c = a.cos + a.positions[t] * half;
    const float* s = a.sin + a.positions[t] * half;
    rope_q(a, t, row, c, s);
    T* kdst = k_pool + a.slots[t] * nkv * H;
    T* vdst = v_pool + a.slots[t] * nkv * H;
    for (int64_t h = 0; h < nkv; ++h) {
      rope_store(row + (nq + h) * H, kdst + h * H, c, s, half);
      copy_row(row + (nq + nkv + h) * H, vdst + h * H, H);
    }
  }
}

template <typename T>
void rope_and_cache_int8_impl(const RopeArgs<T>& a, int8_t* k_pool, int8_t* v_pool, float* k_scale, float* v_scale) {
  const int64_t H = a.head_dim, half = H / 2, nq = a.num_heads, nkv = a.num_kv_heads;
  const bool par = parallel_worth(a.num_tokens, a.num_tokens * (nq + 2 * nkv) * H * 4);
#pragma omp parallel if (par)
  {
    std::vector<float> buf(H);  // one K head after RoPE, rounded to the dtype, in fp32
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a.num_tokens; ++t) {
      const T* row = a.qkv + t * a.width;
      const float* c = a.cos + a.positions[t] * half;
      const float* s = a.sin + a.positions[t] * half;
      rope_q(a, t, row, c, s);
      const int64_t slot = a.slots[t] * nkv;  // (slot, head 0) in the scale pools
      float* rot = buf.data();
      for (int64_t h = 0; h < nkv; ++h) {
        rope_head(row + (nq + h) * H, c, s, half, [&](int64_t i, __m256 lo, __m256 hi, int64_t n) {
          store_n(rot + i, to_dtype<T>(lo), n);
          store_n(rot + half + i, to_dtype<T>(hi), n);
        });
        quantize_row(rot, H, k_pool + (slot + h) * H, k_scale + slot + h);
        quantize_row(row + (nq + nkv + h) * H, H, v_pool + (slot + h) * H, v_scale + slot + h);
      }
    }
  }
}

// ---- silu_and_mul, gelu_tanh_and_mul ----------------------------------------------------------

// act(gate)·up, act rounded to the dtype before the product (simd::silu8; the AMX linear's
// gate/up epilogue computes the same)
template <typename T>
inline __m256 silu_mul8(__m256 gate, __m256 up) { return _mm256_mul_ps(to_dtype<T>(simd::silu8(gate)), up); }

// gelu_tanh(x) = x·σ(2y), y = √(2/π)·(x + 0.044715·x³): the tanh form's value with one
// exponential (silu8's reciprocal and cap: a large -2y gives x·~0, never 0·inf)
inline __m256 gelu_tanh8(__m256 x) {
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
  const __m256 neg = _mm256_min_ps(_mm256_mul_ps(_mm256_set1_ps(-2.f), y), _mm256_set1_ps(80.f));
  const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.f), simd::exp8(neg));
  __m256 r = _mm256_rcp_ps(d);
  r = _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.f)));
  return _mm256_mul_ps(x, r);
}

template <typename T>
inline __m256 gelu_mul8(__m256 gate, __m256 up) { return _mm256_mul_ps(to_dtype<T>(gelu_tanh8(gate)), up); }

template <typename T, __m256 (*Act)(__m256, __m256)>
void act_and_mul_impl(const T* gate_up, T* out, int64_t T_, int64_t F) {
  // tasks: (row, chunk of kChunk columns); each output element is computed on its own
  constexpr int64_t kChunk = 1024;
  const int64_t chunks = (F + kChunk - 1) / kChunk, tasks = T_ * chunks;
#pragma omp parallel for schedule(static) if (parallel_worth(tasks, T_ * F * 4))
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t t = task / chunks, b = task % chunks * kChunk, e = std::min(F, b + kChunk);
    const T* g = gate_up + t * 2 * F;
    T* o = out + t * F;
    int64_t i = b;
    for (; i + 8 <= e; i += 8) store8(o + i, Act(load8(g + i), load8(g + F + i)));
    if (i < e) store_tail(o + i, Act(load_tail(g + i, e - i), load_tail(g + F + i, e - i)), e - i);
  }
}

}  // namespace

void rms_norm(const float* x, const float* w, float* out, float* residual, int64_t T, int64_t D, float eps) {
  rms_norm_impl(x, w, out, residual, T, D, eps);
}
void rms_norm(const uint16_t* x, const uint16_t* w, uint16_t* out, uint16_t* residual, int64_t T, int64_t D,
              float eps) {
  rms_norm_impl(x, w, out, residual, T, D, eps);
}

void qk_sum_squares(const float* qkv, float* sums, int64_t T, int64_t q_size, int64_t kv_size) {
  qk_sum_squares_impl(qkv, sums, T, q_size, kv_size);
}
void qk_sum_squares(const uint16_t* qkv, float* sums, int64_t T, int64_t q_size, int64_t kv_size) {
  qk_sum_squares_impl(qkv, sums, T, q_size, kv_size);
}
void whole_projection_norm(const WholeNormArgs<float>& a) { whole_projection_norm_impl(a); }
void whole_projection_norm(const WholeNormArgs<uint16_t>& a) { whole_projection_norm_impl(a); }

void rope_and_cache(const RopeArgs<float>& a, float* k_pool, float* v_pool) { rope_and_cache_impl(a, k_pool, v_pool); }
void rope_and_cache(const RopeArgs<uint16_t>& a, uint16_t* k_pool, uint16_t* v_pool) {
  rope_and_cache_impl(a, k_pool, v_pool);
}

void rope_and_cache_int8(const RopeArgs<float>& a, int8_t* k_pool, int8_t* v_pool, float* k_scale, float* v_scale) {
  rope_and_cache_int8_impl(a, k_pool, v_pool, k_scale, v_scale);
}
void rope_and_cache_int8(const RopeArgs<uint16_t>& a, int8_t* k_pool, int8_t* v_pool, float* k_scale,
                         float* v_scale) {
  rope_and_cache_int8_impl(a, k_pool, v_pool, k_scale, v_scale);
}

void silu_and_mul(const float* gate_up, float* out, int64_t T, int64_t F) {
  act_and_mul_impl<float, silu_mul8<float>>(gate_up, out, T, F);
}
void silu_and_mul(const uint16_t* gate_up, uint16_t* out, int64_t T, int64_t F) {
  act_and_mul_impl<uint16_t, silu_mul8<uint16_t>>(gate_up, out, T, F);
}
void gelu_tanh_and_mul(const float* gate_up, float* out, int64_t T, int64_t F) {
  act_and_mul_impl<float, gelu_mul8<float>>(gate_up, out, T, F);
}
void gelu_tanh_and_mul(const uint16_t* gate_up, uint16_t* out, int64_t T, int64_t F) {
  act_and_mul_impl<uint16_t, gelu_mul8<uint16_t>>(gate_up, out, T, F);
}

}  // namespace nra
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
