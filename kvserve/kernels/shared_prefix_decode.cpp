// A decode batch's shared-prefix plan run whole in C++ (kvserve/attention/shared_prefix_plan.py builds it
// once per step): each row's own suffix first, then each level's members against the level's
// blocks, each merged into its rows in place through the log-sum-exp, outer levels before inner
// ones. The fused decode step (fused_decode.cpp) calls this per layer, so a step with a plan
// stays one C++ call; the layer-by-layer path calls the same function, so both give the same
// bits. The order of parts per row (suffix, then levels outer to inner) is the reference's.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/index_select.h>
#include <ATen/record_function.h>

#include "kernels.h"

at::Tensor shared_prefix_decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor block_tables,
                                    at::Tensor context_lens, const SharedPrefixDecodePlan& plan, double scale,
                                    c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale, double softcap) {
  RECORD_FUNCTION(kDecodeAttentionRange, std::vector<c10::IValue>());  // as paged_decode_attention's
  TORCH_CHECK(q.dim() == 3, "shared_prefix_decode_attention: q [B, N_q, H]");
  const int64_t B = q.size(0), num_heads = q.size(1), H = q.size(2);
  TORCH_CHECK(plan.suffix_start.numel() == B, "shared_prefix_decode_attention: one suffix start per row, got ",
              plan.suffix_start.numel(), " for ", B, " rows");
  auto [acc_out, acc_lse] =
      paged_decode_attention_lse(q, k_pool, v_pool, block_tables, context_lens, plan.suffix_start, scale, k_scale, v_scale,
                                 softcap);
  float* acc = acc_out.data_ptr<float>();
  float* acc_l = acc_lse.data_ptr<float>();
  for (const SharedPrefixLevel& level : plan.levels) {
    TORCH_CHECK(level.members.scalar_type() == at::kLong && level.members.dim() == 1,
                "shared_prefix_decode_attention: int64 [n] members");
    const at::Tensor members = level.members.contiguous();
    const int64_t n = members.numel();
    const int64_t* rows = members.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)  // ascending: the in-place merges below write distinct rows
      TORCH_CHECK(0 <= rows[i] && rows[i] < B && (i == 0 || rows[i] > rows[i - 1]),
                  "shared_prefix_decode_attention: members must be ascending rows of the batch of ", B, ", got ", rows[i]);
    auto [o, lse] = shared_prefix_attention(at::index_select(q, 0, members), k_pool, v_pool, level.blocks,
                                            level.num_positions, scale, k_scale, v_scale, softcap);
    const float* op = o.data_ptr<float>();
    const float* lp = lse.data_ptr<float>();
    at::parallel_for(0, n * num_heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t dst = rows[r / num_heads] * num_heads + r % num_heads;
        merge_attention_row(acc + dst * H, acc_l[dst], op + r * H, lp[r], H, acc + dst * H, nullptr, acc_l + dst);
      }
    });
  }
  return acc_out.to(q.scalar_type());
}
