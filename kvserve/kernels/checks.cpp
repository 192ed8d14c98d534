// Argument checks every level's kernels share (torch only, no intrinsics): compiled into
// every build with the rest of the glue (kvserve/kernels/build.py).
#include <ATen/core/Tensor.h>

#include "kernels.h"

void check_int8_pools(const at::Tensor& k_pool, const at::Tensor& v_pool, const c10::optional<at::Tensor>& k_scale,
                      const c10::optional<at::Tensor>& v_scale, const char* who) {
  TORCH_CHECK(v_pool.scalar_type() == at::kChar && k_scale && v_scale && k_scale->scalar_type() == at::kFloat &&
                  v_scale->scalar_type() == at::kFloat && k_scale->is_contiguous() && v_scale->is_contiguous(),
              who, ": int8 pools need their contiguous float32 scales");
  TORCH_CHECK(k_scale->numel() * k_pool.size(3) == k_pool.numel() && v_scale->numel() * v_pool.size(3) == v_pool.numel(),
              who, ": one scale per (slot, KV head)");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), who, ": pools must be contiguous");
}

void check_shared_prefix_args(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                              const at::Tensor& prefix_blocks_in, int64_t prefix_len, const c10::optional<at::Tensor>& k_scale,
                              const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "shared_prefix_attention: shapes");
  const bool int8 = k_pool.scalar_type() == at::kChar;
  if (int8)
    check_int8_pools(k_pool, v_pool, k_scale, v_scale, "shared_prefix_attention");
  else
    TORCH_CHECK(!k_scale && !v_scale, "shared_prefix_attention: scales are for int8 pools only");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 &&
                  (int8 || (k_pool.scalar_type() == at::kBFloat16 && v_pool.scalar_type() == at::kBFloat16)),
              "shared_prefix_attention: bf16 queries and bf16 or int8 pools");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "shared_prefix_attention: pools must be contiguous");
  TORCH_CHECK(prefix_blocks_in.scalar_type() == at::kInt && prefix_blocks_in.dim() == 1, "shared_prefix_attention: int32 [P] blocks");
  const int64_t num_heads = q.size(1), H = q.size(2);
  const int64_t block_size = k_pool.size(1), num_kv_heads = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == H && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "shared_prefix_attention: head counts");
  TORCH_CHECK(H % kDecodeAttentionHeadDimMultipleBf16 == 0 && H <= kDecodeAttentionMaxHeadDim,
              "shared_prefix_attention: head_dim must be a multiple of ", kDecodeAttentionHeadDimMultipleBf16,
              ", at most ", kDecodeAttentionMaxHeadDim, ", got ", H);
  TORCH_CHECK(0 <= prefix_len && prefix_len <= prefix_blocks_in.numel() * block_size,
              "shared_prefix_attention: prefix_len ", prefix_len, " past its ", prefix_blocks_in.numel(), " blocks");
  const at::Tensor prefix_blocks = prefix_blocks_in.contiguous();
  const int32_t* blocks = prefix_blocks.data_ptr<int32_t>();
  for (int64_t i = 0; i < (prefix_len + block_size - 1) / block_size; ++i)
    TORCH_CHECK(0 <= blocks[i] && blocks[i] < k_pool.size(0), "shared_prefix_attention: block ", blocks[i], " outside the pool");
}

void check_prefill_args(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& slots,
                        const at::Tensor& segments, double scale, const at::Tensor& out,
                        const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && out.sizes() == q.sizes(), "paged_prefill_attention: shapes");
  const bool int8 = k_pool.scalar_type() == at::kChar;
  const auto pool_type = int8 ? at::kChar : at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_pool.scalar_type() == pool_type &&
                  v_pool.scalar_type() == pool_type && out.scalar_type() == at::kBFloat16,
              "paged_prefill_attention: bf16 queries, bf16 or int8 pools");
  if (int8) {
    check_int8_pools(k_pool, v_pool, k_scale, v_scale, "paged_prefill_attention");
  } else {
    TORCH_CHECK(!k_scale && !v_scale, "paged_prefill_attention: scales are for int8 pools only");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && segments.scalar_type() == at::kLong && segments.dim() == 2 &&
                  segments.size(1) == 4, "paged_prefill_attention: int64 slots and [n, 4] segments");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && out.is_contiguous(), "contiguous pools and out");
  const int64_t D = q.size(2), num_heads = q.size(1), num_kv = k_pool.size(2);
  TORCH_CHECK(D % kPrefillAttentionHeadDimMultiple == 0 && k_pool.size(3) == D && num_heads % num_kv == 0,
              "paged_prefill_attention: head_dim % ", kPrefillAttentionHeadDimMultiple, " == 0, got ", D);
  TORCH_CHECK(scale > 0, "paged_prefill_attention: scale > 0 (the row maximum is taken before scaling)");
}

void check_rope_and_cache_int8_args(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& slot_mapping,
                                    const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& k_scale,
                                    const at::Tensor& v_scale, int64_t head_dim) {
  TORCH_CHECK(qkv.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && k_scale.is_contiguous() &&
                  v_scale.is_contiguous(), "rope_and_cache_int8: contiguous");
  TORCH_CHECK(k_pool.scalar_type() == at::kChar && v_pool.scalar_type() == at::kChar &&
                  k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat,
              "rope_and_cache_int8: int8 pools and float32 scales");
  TORCH_CHECK(k_scale.numel() * head_dim == k_pool.numel() && v_scale.numel() * head_dim == v_pool.numel(),
              "rope_and_cache_int8: one scale per (slot, KV head)");
  TORCH_CHECK(head_dim % kRopeHeadDimMultiple == 0, "rope_and_cache_int8: head_dim % ", kRopeHeadDimMultiple, " == 0, got ", head_dim);
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong, "int64 positions/slots");
}
