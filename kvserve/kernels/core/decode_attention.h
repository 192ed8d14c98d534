// Paged decode attention, torch-free (the core of kernels.h's
// paged_decode_attention and paged_decode_attention_lse): one query row per request, its
// g = N_q / N_kv query heads per KV head reading each K/V row of that head once, in place in
// the block pool through the block table.
//
// Pools [num_blocks, block_size, N_kv, H]: bf16 (uint16_t), fp32, or int8 with fp32 scales
// [num_blocks, block_size, N_kv] (one per slot and KV head, the rule of
// kvserve/attention/kv_pool.py quantize_kv). Queries bf16 (uint16_t) or fp32.
//
// Arithmetic (decode_attention_core.cpp describes the layout and blocking):
//   score = (q·k summed in fp32) · scale      (int8: · k_scale · scale)
//   with a softcap, score = softcap · tanh(score / softcap) (simd::softcap8)
//   online softmax in fp32 over tiles of kTile positions: running max, the sum of the fp32
//   e^(score - max), the output accumulators rescaled when the max grows;
//   P·V in fp32 with P = e^(score - max) rounded to bf16 for bf16 pools (as a bf16 pair dot
//   takes it), fp32 for fp32 pools, fp32 times the V scale for int8;
// At the bf16 pair-dot levels (simd::kBf16Dot) with bf16 queries and pools, q·k sums feature
// pairs and P·V position pairs, one VDPBF16PS each, in order.
//   out = acc / Σ, lse = max + log Σ.
// A row's positions [start, len) are cut into splits of kSplit positions counted from its
// start (each split its own online softmax), merged in order: the split depends on the row's
// own range only, so a row's bits never depend on the other rows of the call, the batch
// size, the thread count or the scheduling.
#pragma once
#include <cstdint>

#include "simd.h"

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace decode_attention {

constexpr int64_t kMaxQueriesPerKvHead = 16;  // kernels.h kDecodeAttentionMaxQueriesPerKvHead
constexpr int64_t kMaxHeadDim = 256;          // kernels.h kDecodeAttentionMaxHeadDim
// positions per online-softmax step (the pair levels: 64, half the per-step work of rescaling
// and bookkeeping per position; their dot products leave that work a larger share)
constexpr int64_t kTile = 32;
constexpr int64_t kSplit = 256;               // positions per split (a multiple of kTile)

enum class PoolType { kBf16, kFp32, kInt8 };

struct Args {
  const void* q = nullptr;  // [B, N_q, H], bf16 (uint16_t) if q_bf16 else fp32
  bool q_bf16 = false;
  PoolType pool = PoolType::kBf16;
  const void* k_pool = nullptr;  // [num_blocks, block_size, N_kv, H] of `pool`'s type
  const void* v_pool = nullptr;
  const float* k_scale = nullptr;  // int8 only: [num_blocks, block_size, N_kv]
  const float* v_scale = nullptr;
  const int32_t* block_tables = nullptr;     // [B, max_blocks]
  const int32_t* context_lens = nullptr;     // [B]
  const int32_t* start_positions = nullptr;  // [B] or null (all 0)
  int64_t B = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, block_size = 0, max_blocks = 0;
  float scale = 1.f;
  float softcap = 0.f;  // > 0: each score capped to softcap·tanh(score / softcap) before the softmax (Gemma 2)
  void* out = nullptr;  // [B, N_q, H], bf16 (uint16_t) if out_bf16 else fp32
  bool out_bf16 = false;
  float* lse = nullptr;  // [B, N_q] or null
};

// Requires: num_heads % num_kv_heads == 0, g <= kMaxQueriesPerKvHead, head_dim a multiple of
// 16 (32 for bf16 and int8 pools) and <= kMaxHeadDim, 0 <= start <= len <= the table's
// positions (the torch layer checks these). An empty range gives out 0 and lse -inf.
void paged_decode_attention(const Args& a);

}  // namespace decode_attention
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
