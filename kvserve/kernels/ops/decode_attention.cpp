// paged_decode_attention (and its _lse variant): the argument checks, then the torch-free core
// (core/decode_attention.h). bf16, fp32 and int8 pools (int8 with their fp32 scales).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/record_function.h>

#include <tuple>
#include <vector>

#include "../core/decode_attention.h"
#include "../kernels.h"

KVSERVE_KERNEL_FAMILY("decode_attention");

namespace decode_attention_core = kvserve::KVSERVE_LEVEL_NS::decode_attention;

static_assert(decode_attention_core::kMaxQueriesPerKvHead == kDecodeAttentionMaxQueriesPerKvHead, "the core's limits are kernels.h's");
static_assert(decode_attention_core::kMaxHeadDim == kDecodeAttentionMaxHeadDim, "the core's limits are kernels.h's");

namespace {

constexpr int64_t kMaxG = kDecodeAttentionMaxQueriesPerKvHead;

// the call's shapes into the core's arguments (q, tables and lengths contiguous)
decode_attention_core::Args core_args(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, double softcap) {
  TORCH_CHECK(softcap >= 0, "paged_decode_attention: softcap must be >= 0 (0: none), got ", softcap);
  decode_attention_core::Args a;
  a.q = q.data_ptr();
  a.q_bf16 = q.scalar_type() == at::kBFloat16;
  a.pool = k_pool.scalar_type() == at::kChar    ? decode_attention_core::PoolType::kInt8
           : k_pool.scalar_type() == at::kFloat ? decode_attention_core::PoolType::kFp32
                                                : decode_attention_core::PoolType::kBf16;
  a.k_pool = k_pool.data_ptr();
  a.v_pool = v_pool.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.context_lens = context_lens.data_ptr<int32_t>();
  a.B = q.size(0);
  a.num_heads = q.size(1);
  a.head_dim = q.size(2);
  a.num_kv_heads = k_pool.size(2);
  a.block_size = k_pool.size(1);
  a.max_blocks = block_tables.size(1);
  a.scale = static_cast<float>(scale);
  a.softcap = static_cast<float>(softcap);
  return a;
}

void check_heads(int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "paged_decode_attention: head counts");
  const int64_t g = num_heads / num_kv_heads;
  TORCH_CHECK(g <= kMaxG, "paged_decode_attention: at most ", kMaxG, " query heads per KV head, got ", g);
}

}  // namespace

// q: [B, N_q, H]; pools: [num_blocks, block_size, N_kv, H]; block_tables: [B, max_blocks] int32;
// context_lens: [B] int32 (S0 + 1, the new position's K/V already written). Returns [B, N_q, H].
// int8 pools come with their scales k_scale / v_scale [num_blocks, block_size, N_kv] fp32.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                  at::Tensor block_tables, at::Tensor context_lens, double scale,
                                  c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale, double softcap) {
  // a profiler range (nothing when no profiler runs): `kvserve bench throughput
  // --profile-attention` sums these per decode step, inside the fused step too
  RECORD_FUNCTION(kDecodeAttentionRange, std::vector<c10::IValue>());
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4, "paged_decode_attention: shapes");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt, "int32 tables");
  const int64_t head_dim = q.size(2);
  if (k_pool.scalar_type() == at::kChar) {
    check_int8_pools(k_pool, v_pool, k_scale, v_scale, "paged_decode_attention");
    TORCH_CHECK(head_dim % kDecodeAttentionHeadDimMultipleBf16 == 0 && head_dim <= kDecodeAttentionMaxHeadDim,
                "paged_decode_attention: int8 head_dim must be a multiple of ", kDecodeAttentionHeadDimMultipleBf16,
                ", at most ", kDecodeAttentionMaxHeadDim, ", got ", head_dim);
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
                "paged_decode_attention: bf16 or fp32 queries");
  } else {
    TORCH_CHECK(!k_scale && !v_scale, "paged_decode_attention: scales are for int8 pools only");
    TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(), "dtypes");
    TORCH_CHECK(head_dim % kDecodeAttentionHeadDimMultipleFp32 == 0 && head_dim <= kDecodeAttentionMaxHeadDim,
                "paged_decode_attention: head_dim must be a multiple of ", kDecodeAttentionHeadDimMultipleFp32,
                ", at most ", kDecodeAttentionMaxHeadDim, ", got ", head_dim);
    TORCH_CHECK(q.scalar_type() != at::kBFloat16 || head_dim % kDecodeAttentionHeadDimMultipleBf16 == 0,
                "paged_decode_attention: bf16 head_dim must be a multiple of ", kDecodeAttentionHeadDimMultipleBf16,
                ", got ", head_dim);
    TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "bf16 or fp32");
  }
  TORCH_CHECK(k_pool.size(3) == head_dim && v_pool.sizes() == k_pool.sizes(), "paged_decode_attention: shapes");
  check_heads(q.size(1), k_pool.size(2));
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(context_lens.numel() == q.size(0) && block_tables.size(0) == q.size(0),
              "paged_decode_attention: one table and length per row");
  auto out = at::empty_like(q);
  decode_attention_core::Args a = core_args(q, k_pool, v_pool, block_tables, context_lens, scale, softcap);
  if (k_pool.scalar_type() == at::kChar) {
    a.k_scale = k_scale->data_ptr<float>();
    a.v_scale = v_scale->data_ptr<float>();
  }
  a.out = out.data_ptr();
  a.out_bf16 = q.scalar_type() == at::kBFloat16;
  decode_attention_core::paged_decode_attention(a);
  return out;
}

// The suffix half of shared-prefix attention: row b attends to its positions
// [start_positions[b], context_lens[b]) only. Returns (out [B, N_q, H] fp32, normalised;
// lse [B, N_q] fp32, max + log Σ exp(scale·q·k)); an empty range gives out 0, lse -inf.
// bf16 or fp32 queries and pools, or int8 pools with their scales.
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_lse(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                                              at::Tensor block_tables, at::Tensor context_lens,
                                                              at::Tensor start_positions, double scale,
                                                              c10::optional<at::Tensor> k_scale,
                                                              c10::optional<at::Tensor> v_scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4, "paged_decode_attention_lse: shapes");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  start_positions.scalar_type() == at::kInt, "paged_decode_attention_lse: int32 tables");
  const bool int8 = k_pool.scalar_type() == at::kChar;
  if (int8)
    check_int8_pools(k_pool, v_pool, k_scale, v_scale, "paged_decode_attention_lse");
  else
    TORCH_CHECK(!k_scale && !v_scale, "paged_decode_attention_lse: scales are for int8 pools only");
  TORCH_CHECK(int8 || (q.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type()), "dtypes");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim % kDecodeAttentionHeadDimMultipleFp32 == 0 && head_dim <= kDecodeAttentionMaxHeadDim,
              "paged_decode_attention_lse: head_dim must be a multiple of ", kDecodeAttentionHeadDimMultipleFp32,
              ", at most ", kDecodeAttentionMaxHeadDim, ", got ", head_dim);
  TORCH_CHECK(q.scalar_type() != at::kBFloat16 || head_dim % kDecodeAttentionHeadDimMultipleBf16 == 0,
              "paged_decode_attention_lse: bf16 head_dim must be a multiple of ", kDecodeAttentionHeadDimMultipleBf16);
  TORCH_CHECK(!int8 || head_dim % kDecodeAttentionHeadDimMultipleBf16 == 0,
              "paged_decode_attention_lse: int8 head_dim must be a multiple of ", kDecodeAttentionHeadDimMultipleBf16);
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "paged_decode_attention_lse: bf16 or fp32 queries");
  TORCH_CHECK(k_pool.size(3) == head_dim && v_pool.sizes() == k_pool.sizes(), "paged_decode_attention_lse: shapes");
  check_heads(q.size(1), k_pool.size(2));
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  start_positions = start_positions.contiguous();
  const int64_t B = q.size(0), num_heads = q.size(1), block_size = k_pool.size(1);
  TORCH_CHECK(context_lens.numel() == B && start_positions.numel() == B && block_tables.size(0) == B,
              "paged_decode_attention_lse: one table, length and start per row");
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* starts = start_positions.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= starts[b] && starts[b] <= lens[b] && lens[b] <= block_tables.size(1) * block_size,
                "paged_decode_attention_lse: row ", b, " needs 0 <= start <= len <= its table's positions");
  auto out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  auto lse = at::empty({B, num_heads}, q.options().dtype(at::kFloat));
  decode_attention_core::Args a = core_args(q, k_pool, v_pool, block_tables, context_lens, scale, softcap);
  if (int8) {
    a.k_scale = k_scale->data_ptr<float>();
    a.v_scale = v_scale->data_ptr<float>();
  }
  a.start_positions = starts;
  a.out = out.data_ptr<float>();
  a.out_bf16 = false;
  a.lse = lse.data_ptr<float>();
  decode_attention_core::paged_decode_attention(a);
  return {out, lse};
}
