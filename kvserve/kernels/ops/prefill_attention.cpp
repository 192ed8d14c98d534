// paged_prefill_attention: the argument checks, then the torch-free core (core/prefill_attention.h).
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

#include "../core/prefill_attention.h"
#include "../kernels.h"

KVSERVE_KERNEL_FAMILY("prefill_attention");

// q, out: [T, N_q, D] bf16 (out written only at the segments' rows); pools [num_blocks,
// block_size, N_kv, D] bf16, or int8 with their scales k_scale / v_scale [num_blocks,
// block_size, N_kv] fp32; slots: int64, every segment's context slots back to back;
// segments: int64 [n, 4] = (query_start, num_new, num_cached, slot_offset).
// shared: int64 [n, 2] = (leader, shared_len) per segment, or none: a member's first
// shared_len positions (a multiple of 64, within its cached history) are its leader's, whose
// packed K/V it reads instead of packing them again (the pool read once per group; the same
// values, so the same bits). A leader and a segment alone have (itself, 0).
void paged_prefill_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slots,
                             at::Tensor segments, double scale, at::Tensor out, c10::optional<at::Tensor> k_scale,
                             c10::optional<at::Tensor> v_scale, c10::optional<at::Tensor> shared, double softcap) {
  check_prefill_args(q, k_pool, v_pool, slots, segments, scale, out, k_scale, v_scale);
  TORCH_CHECK(softcap >= 0, "paged_prefill_attention: softcap must be >= 0 (0: none), got ", softcap);
  const bool int8 = k_pool.scalar_type() == at::kChar;
  const int64_t D = q.size(2), num_heads = q.size(1), num_kv = k_pool.size(2);
  q = q.contiguous();
  slots = slots.contiguous();
  segments = segments.contiguous();
  const int64_t n = segments.size(0);
  const int64_t* seg = segments.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(seg[i * 4 + 3] + seg[i * 4 + 1] + seg[i * 4 + 2] <= slots.numel() && seg[i * 4] + seg[i * 4 + 1] <= q.size(0),
                "segment ", i, " out of range");
  // each segment's (leader, shared_len), checked: the shared slots must be the leader's
  std::vector<int64_t> leader_of(n), shared_len(n, 0);
  for (int64_t i = 0; i < n; ++i) leader_of[i] = i;
  bool any_shared = false;
  if (shared) {
    TORCH_CHECK(shared->scalar_type() == at::kLong && shared->dim() == 2 && shared->size(0) == n && shared->size(1) == 2,
                "paged_prefill_attention: shared must be int64 [n, 2] (leader, shared_len)");
    const at::Tensor sh = shared->contiguous();
    const int64_t* sp = sh.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t lead = sp[i * 2], len = sp[i * 2 + 1];
      if (len == 0) continue;
      TORCH_CHECK(0 <= lead && lead < n && lead != i && sp[lead * 2 + 1] == 0 && len % 64 == 0 && len <= seg[i * 4 + 2] &&
                      len <= seg[lead * 4 + 1] + seg[lead * 4 + 2],
                  "paged_prefill_attention: segment ", i, " shares ", len, " positions of segment ", lead,
                  ": a leader sharing nothing itself, a multiple of 64 within both histories");
      TORCH_CHECK(std::equal(slot + seg[i * 4 + 3], slot + seg[i * 4 + 3] + len, slot + seg[lead * 4 + 3]),
                  "paged_prefill_attention: segment ", i, "'s first ", len, " slots are not segment ", lead, "'s");
      leader_of[i] = lead;
      shared_len[i] = len;
      any_shared = true;
    }
  }

  kvserve::KVSERVE_LEVEL_NS::PrefillAttentionArgs args;
  args.q = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  args.out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  if (int8) {
    args.k_pool = k_pool.data_ptr<int8_t>();
    args.v_pool = v_pool.data_ptr<int8_t>();
    args.k_scale = k_scale->data_ptr<float>();
    args.v_scale = v_scale->data_ptr<float>();
  } else {
    args.k_pool = k_pool.data_ptr<at::BFloat16>();
    args.v_pool = v_pool.data_ptr<at::BFloat16>();
  }
  args.int8 = int8;
  args.num_heads = num_heads;
  args.num_kv_heads = num_kv;
  args.head_dim = D;
  args.slots = slot;
  args.segments = seg;
  args.num_segments = n;
  args.leader = any_shared ? leader_of.data() : nullptr;
  args.shared_len = any_shared ? shared_len.data() : nullptr;
  args.scale = static_cast<float>(scale);
  args.softcap = static_cast<float>(softcap);
  kvserve::KVSERVE_LEVEL_NS::paged_prefill_attention(args);
}
