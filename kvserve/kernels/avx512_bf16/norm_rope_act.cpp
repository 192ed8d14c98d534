// The fused elementwise steps of a layer: rms_norm (optionally after the residual add),
// rope_and_cache (RoPE on Q and K, K/V written to their pool slots; rope_and_cache_int8
// quantizes them into int8 pools and their scales), silu_and_mul. Each replaces 5-10 small
// torch ops whose per-call overhead dominates at decode sizes.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../kernels.h"
#include "vec_math.h"

KVSERVE_KERNEL_FAMILY("norm_rope_act");

namespace {

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
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps, c10::optional<at::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % kRmsNormWidthMultiple == 0,
              "rms_norm: [T, D] contiguous, D % ", kRmsNormWidthMultiple, " == 0, got ", x.sizes());
  const int64_t T_ = x.size(0), D = x.size(1);
  auto out = at::empty_like(x);
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
at::Tensor rope_and_cache(at::Tensor qkv, at::Tensor positions, at::Tensor cos_table, at::Tensor sin_table,
                          at::Tensor k_pool, at::Tensor v_pool, at::Tensor slot_mapping,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(), "rope_and_cache: contiguous");
  TORCH_CHECK(head_dim % kRopeHeadDimMultiple == 0, "rope_and_cache: head_dim % ", kRopeHeadDimMultiple, " == 0, got ", head_dim);
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong, "int64 positions/slots");
  const int64_t T_ = qkv.size(0), width = qkv.size(1), half = head_dim / 2;
  auto q = at::empty({T_, num_heads, head_dim}, qkv.options());
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

namespace {

// The int8 KV rule of kvserve/attention/kv_pool.py quantize_kv, for one row of H values (a
// multiple of 16) of one position and KV head: scale = max|x| / 127, q = round(x / scale)
// clamped to ±127 (the conversion rounds half to even, as torch.round), a zero row q = 0,
// scale 0. A true division, as torch's, so both writers store the same bytes for the same x.
template <typename T>
void quantize_row(const T* x, int64_t H, int8_t* dst, float* scale_out) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(x + i)));
  const float scale = _mm512_reduce_max_ps(mx) / 127.f;
  *scale_out = scale;
  const __m512 div = _mm512_set1_ps(scale > 0.f ? scale : 1.f);
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t i = 0; i < H; i += 16) {
    const __m512 q = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(load16(x + i), div), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q)));
  }
}

}  // namespace

// rope_and_cache for int8 pools: the same RoPE; K (rotated, rounded to the model dtype as the
// float cache would hold it) and V quantized per KV head (quantize_row) into their slots of
// the int8 pools, the scales into k_scale / v_scale [num_blocks, block_size, N_kv] fp32.
at::Tensor rope_and_cache_int8(at::Tensor qkv, at::Tensor positions, at::Tensor cos_table, at::Tensor sin_table,
                               at::Tensor k_pool, at::Tensor v_pool, at::Tensor k_scale, at::Tensor v_scale,
                               at::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_rope_and_cache_int8_args(qkv, positions, slot_mapping, k_pool, v_pool, k_scale, v_scale, head_dim);
  const int64_t T_ = qkv.size(0), width = qkv.size(1), half = head_dim / 2;
  auto q = at::empty({T_, num_heads, head_dim}, qkv.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* cos = cos_table.data_ptr<float>();
  const float* sin = sin_table.data_ptr<float>();
  int8_t* kq = k_pool.data_ptr<int8_t>();
  int8_t* vq = v_pool.data_ptr<int8_t>();
  float* ks = k_scale.data_ptr<float>();
  float* vs = v_scale.data_ptr<float>();
  dispatch_f32_bf16(qkv.scalar_type(), "rope_and_cache_int8", [&](auto tag) {
      using T = decltype(tag);
      at::parallel_for(0, T_, 16, [&](int64_t b, int64_t e) {
        std::vector<T> rotated(head_dim);  // one K head after RoPE, in the model dtype
        for (int64_t t = b; t < e; ++t) {
          const T* row = qkv.data_ptr<T>() + t * width;
          const float* c = cos + pos[t] * half; const float* s_ = sin + pos[t] * half;
          for (int64_t h = 0; h < num_heads; ++h) rope_row(row + h * head_dim, q.data_ptr<T>() + (t * num_heads + h) * head_dim, c, s_, head_dim);
          const int64_t slot = slots[t] * num_kv_heads;  // (slot, head 0) in the scale pools
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            rope_row(row + (num_heads + h) * head_dim, rotated.data(), c, s_, head_dim);
            quantize_row(rotated.data(), head_dim, kq + (slot + h) * head_dim, ks + slot + h);
            quantize_row(row + (num_heads + num_kv_heads + h) * head_dim, head_dim, vq + (slot + h) * head_dim, vs + slot + h);
          }
        }
      });
  });
  return q;
}

// gate_up: [T, 2F] → silu(gate) · up: [T, F]
at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(1) % (2 * kSiluWidthMultiple) == 0,
              "silu_and_mul: [T, 2F] contiguous, F % ", kSiluWidthMultiple, " == 0, got ", gate_up.sizes());
  const int64_t T_ = gate_up.size(0), F_ = gate_up.size(1) / 2;
  auto out = at::empty({T_, F_}, gate_up.options());
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
