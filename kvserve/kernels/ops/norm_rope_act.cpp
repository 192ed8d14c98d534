// The norm_rope_act family's torch layer (rms_norm, qk_sum_squares, whole_projection_norm,
// rope_and_cache, rope_and_cache_int8, silu_and_mul, gelu_tanh_and_mul): the argument checks, then the torch-free core (core/norm_rope_act.h), on fp32
// or bf16 tensors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstdint>
#include <type_traits>

#include "../core/norm_rope_act.h"
#include "../kernels.h"

KVSERVE_KERNEL_FAMILY("norm_rope_act");

namespace norm_rope_act_core = kvserve::KVSERVE_LEVEL_NS::nra;

namespace {

// Calls f with a value of the core's element type for `type`: float, or uint16_t for bf16.
template <typename F>
void dispatch_f32_bf16(at::ScalarType type, const char* name, F&& f) {
  if (type == at::kFloat) {
    f(float{});
  } else if (type == at::kBFloat16) {
    f(uint16_t{});
  } else {
    TORCH_CHECK(false, name, ": float32 or bfloat16 only, got ", type);
  }
}

// the data of t as the core's element type E (bf16 as its raw bits)
template <typename E>
E* data(const at::Tensor& t) {
  if constexpr (std::is_same_v<E, float>) {
    return t.data_ptr<float>();
  } else {
    return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
  }
}

template <typename E>
norm_rope_act_core::RopeArgs<E> rope_args(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_table,
                            const at::Tensor& sin_table, const at::Tensor& slot_mapping, const at::Tensor& q,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  norm_rope_act_core::RopeArgs<E> a;
  a.qkv = data<E>(qkv);
  a.width = qkv.size(1);
  a.positions = positions.data_ptr<int64_t>();
  a.cos = cos_table.data_ptr<float>();
  a.sin = sin_table.data_ptr<float>();
  a.slots = slot_mapping.data_ptr<int64_t>();
  a.num_tokens = qkv.size(0);
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.head_dim = head_dim;
  a.q_out = data<E>(q);
  return a;
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
    using E = decltype(tag);
    norm_rope_act_core::rms_norm(data<E>(x), data<E>(weight), data<E>(out), residual ? data<E>(*residual) : nullptr, T_, D,
                   static_cast<float>(eps));
  });
  return out;
}

// OLMoE's q/k norms over the whole projections (core/norm_rope_act.h WholeNormArgs)
namespace {
void check_whole_qkv(const at::Tensor& qkv, int64_t q_size, int64_t kv_size, const char* name) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && q_size > 0 && kv_size > 0 && qkv.size(1) == q_size + 2 * kv_size,
              name, ": qkv must be [T, q_size + 2·kv_size] contiguous, got ", qkv.sizes(), " for q_size ", q_size,
              ", kv_size ", kv_size);
}
}  // namespace

at::Tensor qk_sum_squares(at::Tensor qkv, int64_t q_size, int64_t kv_size) {
  check_whole_qkv(qkv, q_size, kv_size, "qk_sum_squares");
  auto sums = at::empty({qkv.size(0), 2}, qkv.options().dtype(at::kFloat));
  dispatch_f32_bf16(qkv.scalar_type(), "qk_sum_squares", [&](auto tag) {
    using E = decltype(tag);
    norm_rope_act_core::qk_sum_squares(data<E>(qkv), sums.data_ptr<float>(), qkv.size(0), q_size, kv_size);
  });
  return sums;
}

at::Tensor whole_projection_norm(at::Tensor qkv, at::Tensor q_weight, at::Tensor k_weight, int64_t q_size,
                                 int64_t kv_size, double q_width, double k_width, double eps,
                                 c10::optional<at::Tensor> sums) {
  check_whole_qkv(qkv, q_size, kv_size, "whole_projection_norm");
  TORCH_CHECK(q_weight.numel() == q_size && k_weight.numel() == kv_size && q_weight.is_contiguous() &&
                  k_weight.is_contiguous() && q_weight.scalar_type() == qkv.scalar_type() &&
                  k_weight.scalar_type() == qkv.scalar_type(),
              "whole_projection_norm: weights of q_size and kv_size in qkv's dtype");
  TORCH_CHECK(!sums || (sums->scalar_type() == at::kFloat && sums->is_contiguous() && sums->dim() == 2 &&
                        sums->size(0) == qkv.size(0) && sums->size(1) == 2),
              "whole_projection_norm: sums must be fp32 [T, 2]");
  auto out = at::empty_like(qkv);
  dispatch_f32_bf16(qkv.scalar_type(), "whole_projection_norm", [&](auto tag) {
    using E = decltype(tag);
    norm_rope_act_core::WholeNormArgs<E> a{data<E>(qkv), sums ? sums->data_ptr<float>() : nullptr, data<E>(q_weight),
                                           data<E>(k_weight), data<E>(out), qkv.size(0), q_size, kv_size,
                                           static_cast<float>(q_width), static_cast<float>(k_width),
                                           static_cast<float>(eps)};
    norm_rope_act_core::whole_projection_norm(a);
  });
  return out;
}

// qkv: [T, (N_q + 2 N_kv) · H] from the fused projection. Applies RoPE to Q and K (cos/sin
// tables [max_pos, H/2] fp32), writes K and V into their pool slots, returns Q [T, N_q, H].
at::Tensor rope_and_cache(at::Tensor qkv, at::Tensor positions, at::Tensor cos_table, at::Tensor sin_table,
                          at::Tensor k_pool, at::Tensor v_pool, at::Tensor slot_mapping,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(), "rope_and_cache: contiguous");
  TORCH_CHECK(head_dim % kRopeHeadDimMultiple == 0, "rope_and_cache: head_dim % ", kRopeHeadDimMultiple, " == 0, got ", head_dim);
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong, "int64 positions/slots");
  auto q = at::empty({qkv.size(0), num_heads, head_dim}, qkv.options());
  dispatch_f32_bf16(qkv.scalar_type(), "rope_and_cache", [&](auto tag) {
    using E = decltype(tag);
    norm_rope_act_core::rope_and_cache(rope_args<E>(qkv, positions, cos_table, sin_table, slot_mapping, q, num_heads, num_kv_heads, head_dim),
                         data<E>(k_pool), data<E>(v_pool));
  });
  return q;
}

// rope_and_cache for int8 pools: the same RoPE; K (rotated, rounded to the model dtype as the
// float cache would hold it) and V quantized per KV head into their slots of the int8 pools,
// the scales into k_scale / v_scale [num_blocks, block_size, N_kv] fp32.
at::Tensor rope_and_cache_int8(at::Tensor qkv, at::Tensor positions, at::Tensor cos_table, at::Tensor sin_table,
                               at::Tensor k_pool, at::Tensor v_pool, at::Tensor k_scale, at::Tensor v_scale,
                               at::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_rope_and_cache_int8_args(qkv, positions, slot_mapping, k_pool, v_pool, k_scale, v_scale, head_dim);
  auto q = at::empty({qkv.size(0), num_heads, head_dim}, qkv.options());
  dispatch_f32_bf16(qkv.scalar_type(), "rope_and_cache_int8", [&](auto tag) {
    using E = decltype(tag);
    norm_rope_act_core::rope_and_cache_int8(
        rope_args<E>(qkv, positions, cos_table, sin_table, slot_mapping, q, num_heads, num_kv_heads, head_dim),
        k_pool.data_ptr<int8_t>(), v_pool.data_ptr<int8_t>(), k_scale.data_ptr<float>(), v_scale.data_ptr<float>());
  });
  return q;
}

namespace {

// gate_up: [T, 2F] → act(gate) · up: [T, F]
template <typename Core>
at::Tensor act_and_mul(at::Tensor gate_up, const char* name, Core core) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(1) % (2 * kSiluWidthMultiple) == 0,
              name, ": [T, 2F] contiguous, F % ", kSiluWidthMultiple, " == 0, got ", gate_up.sizes());
  const int64_t T_ = gate_up.size(0), F_ = gate_up.size(1) / 2;
  auto out = at::empty({T_, F_}, gate_up.options());
  dispatch_f32_bf16(gate_up.scalar_type(), name, [&](auto tag) {
    using E = decltype(tag);
    core(data<E>(gate_up), data<E>(out), T_, F_);
  });
  return out;
}

}  // namespace

at::Tensor silu_and_mul(at::Tensor gate_up) {
  return act_and_mul(gate_up, "silu_and_mul", [](auto* g, auto* o, int64_t T_, int64_t F_) {
    norm_rope_act_core::silu_and_mul(g, o, T_, F_);
  });
}

at::Tensor gelu_tanh_and_mul(at::Tensor gate_up) {
  return act_and_mul(gate_up, "gelu_tanh_and_mul", [](auto* g, auto* o, int64_t T_, int64_t F_) {
    norm_rope_act_core::gelu_tanh_and_mul(g, o, T_, F_);
  });
}
