// The fused elementwise steps of a decoder layer, torch-free (the core of kernels.h's
// rms_norm, the whole-projection q/k norm, rope_and_cache, rope_and_cache_int8 and silu_and_mul).
// Each function comes for fp32 (float) and bf16 (uint16_t) tensors; the element type of every
// pointer but the RoPE tables, the int8 pools and their scales is the model dtype. Every
// output element depends only on its own row (token), whatever the row count: no function
// here sums across rows, and each row's sums run in an order fixed by its width alone.
//
// Widths: any D, H (even), F; the vector loops take 8 lanes at a time and a scalar tail does
// the rest with the same operations (the torch layer checks kernels.h's multiples).
// Rounding to bf16 (nearest even) happens where the plain-torch reference rounds to its dtype
// (see each function); with fp32 there is no rounding.
#pragma once
#include <cstdint>

#include "simd.h"

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace nra {

// out[t] = RMSNorm(x[t]) · w: inv = 1 / sqrt(Σ x² / D + eps) in fp32, n = x · inv rounded to
// the dtype, out = n · w rounded to the dtype. With residual (not null): residual[t] += x[t]
// first (in place, rounded to the dtype) and the norm reads the updated residual row. x, out,
// residual [T, D] contiguous, w [D].
void rms_norm(const float* x, const float* w, float* out, float* residual, int64_t T, int64_t D, float eps);
void rms_norm(const uint16_t* x, const uint16_t* w, uint16_t* out, uint16_t* residual, int64_t T, int64_t D,
              float eps);

// OLMoE's q/k norms over the whole Q and the whole K projection of each QKV row
// (model/llama.py WholeProjectionNorm): qkv [T, q_size + 2·kv_size] = Q, K, V features.
// qk_sum_squares: sums[t] = (Σ q², Σ k²) of row t in fp32, each in rms_norm's order (the
// partial sums a tensor-parallel rank AllReduces). whole_projection_norm: out row t = [q ·
// inv_q, k · inv_k, v], inv = 1 / sqrt(Σ / width + eps) in fp32 from `sums` (nullptr: the row's
// own, as qk_sum_squares gives them), each product rounded to the dtype, then times its weight
// (q_weight [q_size], k_weight [kv_size]) rounded to the dtype, as rms_norm; V copied. q_width,
// k_width: the whole projections' widths (under tensor parallelism more than this rank's share).
template <typename T>
struct WholeNormArgs {
  const T* qkv;
  const float* sums;  // [T, 2] or nullptr
  const T* q_weight;
  const T* k_weight;
  T* out;  // [T, q_size + 2·kv_size]
  int64_t num_tokens, q_size, kv_size;
  float q_width, k_width, eps;
};
void qk_sum_squares(const float* qkv, float* sums, int64_t T, int64_t q_size, int64_t kv_size);
void qk_sum_squares(const uint16_t* qkv, float* sums, int64_t T, int64_t q_size, int64_t kv_size);
void whole_projection_norm(const WholeNormArgs<float>& a);
void whole_projection_norm(const WholeNormArgs<uint16_t>& a);

// RoPE (rotate-half) and the KV write of one step's tokens.
//   qkv [T, width] (width >= (N_q + 2 N_kv) · H): row t = Q heads, K heads, V heads, each H wide
//   positions int64 [T]; cos, sin fp32 [max_pos, H/2] (row = position)
//   slots int64 [T]: the pool slot of each token (slot · N_kv · H is its first element)
// Rotation of a head x (half = H/2, c = cos[pos], s = sin[pos]), in fp32 with one FMA each:
//   out[i] = fma(-x[i+half], s[i], x[i]·c[i]),  out[i+half] = fma(x[i], s[i], x[i+half]·c[i])
// rounded to the dtype as it is stored.
template <typename T>
struct RopeArgs {
  const T* qkv;
  int64_t width;
  const int64_t* positions;
  const float* cos;
  const float* sin;
  const int64_t* slots;
  int64_t num_tokens, num_heads, num_kv_heads, head_dim;
  T* q_out;  // [T, N_q, H]
};

// Q rotated into q_out; K rotated and V copied into their slots of k_pool / v_pool
// ([num_slots, N_kv, H] in the dtype).
void rope_and_cache(const RopeArgs<float>& a, float* k_pool, float* v_pool);
void rope_and_cache(const RopeArgs<uint16_t>& a, uint16_t* k_pool, uint16_t* v_pool);

// The same, K (rotated and rounded to the dtype, as the float cache would hold it) and V
// quantized per (slot, KV head) row of H into int8 pools [num_slots, N_kv, H] with one fp32
// scale each into k_scale / v_scale [num_slots, N_kv] (kvserve/attention/kv_pool.py quantize_kv):
// scale = max|x| / 127, q = round-half-even(x / scale) clamped to ±127; a zero row: q 0, scale 0.
void rope_and_cache_int8(const RopeArgs<float>& a, int8_t* k_pool, int8_t* v_pool, float* k_scale, float* v_scale);
void rope_and_cache_int8(const RopeArgs<uint16_t>& a, int8_t* k_pool, int8_t* v_pool, float* k_scale,
                         float* v_scale);

// out[t, i] = silu(g) · u for g = gate_up[t, i], u = gate_up[t, F + i]: silu(g) = g / (1 + e^-g)
// in fp32 (e^-g capped at e^80), rounded to the dtype before the product (as the reference
// rounds F.silu's result), the product rounded to the dtype. gate_up [T, 2F], out [T, F].
void silu_and_mul(const float* gate_up, float* out, int64_t T, int64_t F);
void silu_and_mul(const uint16_t* gate_up, uint16_t* out, int64_t T, int64_t F);

// out[t, i] = gelu_tanh(g) · u (Gemma's GeGLU), the same shapes and roundings as silu_and_mul:
// gelu_tanh(g) = g/2 · (1 + tanh(√(2/π)·(g + 0.044715·g³))), computed as g·σ(2·√(2/π)·(g +
// 0.044715·g³)) (the same function: (1 + tanh y)/2 = σ(2y)) in fp32, rounded to the dtype before
// the product as the reference rounds F.gelu(approximate="tanh")'s result.
void gelu_tanh_and_mul(const float* gate_up, float* out, int64_t T, int64_t F);
void gelu_tanh_and_mul(const uint16_t* gate_up, uint16_t* out, int64_t T, int64_t F);

}  // namespace nra
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
