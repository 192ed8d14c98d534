// shared_prefix_attention, merge_attention_states and merge_attention_row: the argument checks
// (shared with checks.cpp), then the torch-free core (core/shared_prefix_attention.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <tuple>

#include "../core/shared_prefix_attention.h"
#include "../kernels.h"

KVSERVE_KERNEL_FAMILY("shared_prefix_attention");

namespace shared_prefix_attention_core = kvserve::KVSERVE_LEVEL_NS::shared_prefix;

static_assert(shared_prefix_attention_core::kMaxHeadDim == kDecodeAttentionMaxHeadDim, "the core's limits are kernels.h's");

// q [n, N_q, H] bf16; pools [num_blocks, block_size, N_kv, H] bf16 (or int8 with their scales);
// prefix_blocks int32 [P]; positions [0, prefix_len) of those blocks, visible to every query
// (non-causal). Returns (out [n, N_q, H] fp32 normalised, lse [n, N_q] fp32 = max + log Σ exp(scale·q·k)).
std::tuple<at::Tensor, at::Tensor> shared_prefix_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                                           at::Tensor prefix_blocks, int64_t prefix_len, double scale,
                                                           c10::optional<at::Tensor> k_scale,
                                                           c10::optional<at::Tensor> v_scale, double softcap) {
  check_shared_prefix_args(q, k_pool, v_pool, prefix_blocks, prefix_len, k_scale, v_scale);
  TORCH_CHECK(softcap >= 0, "shared_prefix_attention: softcap must be >= 0 (0: none), got ", softcap);
  const bool int8 = k_pool.scalar_type() == at::kChar;
  const int64_t n = q.size(0), num_heads = q.size(1), H = q.size(2);
  const int64_t block_size = k_pool.size(1), num_kv_heads = k_pool.size(2);
  q = q.contiguous();
  prefix_blocks = prefix_blocks.contiguous();
  const int32_t* blocks = prefix_blocks.data_ptr<int32_t>();

  auto out = at::empty({n, num_heads, H}, q.options().dtype(at::kFloat));
  auto lse = at::empty({n, num_heads}, q.options().dtype(at::kFloat));
  if (n == 0) return {out, lse};
  shared_prefix_attention_core::Args a;
  a.q = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  a.int8 = int8;
  a.k_pool = k_pool.data_ptr();
  a.v_pool = v_pool.data_ptr();
  if (int8) {
    a.k_scale = k_scale->data_ptr<float>();
    a.v_scale = v_scale->data_ptr<float>();
  }
  a.blocks = blocks;
  a.prefix_len = prefix_len;
  a.n = n;
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.head_dim = H;
  a.block_size = block_size;
  a.scale = static_cast<float>(scale);
  a.softcap = static_cast<float>(softcap);
  a.out = out.data_ptr<float>();
  a.lse = lse.data_ptr<float>();
  shared_prefix_attention_core::shared_prefix_attention(a);
  return {out, lse};
}

// (out_a·e^(lse_a - m) + out_b·e^(lse_b - m)) / (e^(lse_a - m) + e^(lse_b - m)), m = max(lse_a, lse_b),
// in fp32 per row of H; a part with lse -inf has no weight, both -inf give 0 (lse -inf).
// out_* [..., H] fp32, lse_* [...] fp32. Returns (out in out_dtype, merged lse fp32).
std::tuple<at::Tensor, at::Tensor> merge_attention_states(at::Tensor out_a, at::Tensor lse_a, at::Tensor out_b,
                                                          at::Tensor lse_b, at::ScalarType out_dtype) {
  TORCH_CHECK(out_a.scalar_type() == at::kFloat && out_b.scalar_type() == at::kFloat && lse_a.scalar_type() == at::kFloat &&
                  lse_b.scalar_type() == at::kFloat,
              "merge_attention_states: fp32 parts");
  TORCH_CHECK(out_a.sizes() == out_b.sizes() && lse_a.sizes() == lse_b.sizes() && out_a.dim() == lse_a.dim() + 1 &&
                  out_a.sizes().slice(0, lse_a.dim()) == lse_a.sizes(),
              "merge_attention_states: out [..., H] and lse [...] of the same rows");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "merge_attention_states: fp32 or bf16 output");
  TORCH_CHECK(out_a.dim() >= 1 && out_a.size(-1) % 16 == 0, "merge_attention_states: H must be a multiple of 16");
  out_a = out_a.contiguous();
  out_b = out_b.contiguous();
  lse_a = lse_a.contiguous();
  lse_b = lse_b.contiguous();
  const int64_t H = out_a.size(-1), rows = lse_a.numel();
  auto out = at::empty(out_a.sizes(), out_a.options().dtype(out_dtype));
  auto lse = at::empty(lse_a.sizes(), lse_a.options());
  const bool bf16 = out_dtype == at::kBFloat16;
  shared_prefix_attention_core::merge_attention_states(out_a.data_ptr<float>(), lse_a.data_ptr<float>(), out_b.data_ptr<float>(),
                               lse_b.data_ptr<float>(), rows, H, bf16 ? nullptr : out.data_ptr<float>(),
                               bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr,
                               lse.data_ptr<float>());
  return {out, lse};
}

void merge_attention_row(const float* xa, float la, const float* xb, float lb, int64_t H, float* dst_f32,
                         at::BFloat16* dst_bf16, float* lse_out) {
  shared_prefix_attention_core::merge_attention_row(xa, la, xb, lb, H, dst_f32, reinterpret_cast<uint16_t*>(dst_bf16), lse_out);
}
