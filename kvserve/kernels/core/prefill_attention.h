// Causal attention for the prompt tokens of a step, read from the paged KV pool (the torch-free
// core of paged_prefill_attention, kernels.h): each segment's m new queries attend to its S0
// cached + m new positions, query S0 + i seeing keys 0..S0 + i.
#pragma once
#include <cstdint>

namespace kvserve {
namespace KVSERVE_LEVEL_NS {

struct PrefillAttentionArgs {
  const uint16_t* q;   // [T, num_heads, head_dim] bf16, contiguous
  uint16_t* out;       // [T, num_heads, head_dim] bf16, contiguous; written only at the segments' rows
  const void* k_pool;  // [num_slots, num_kv_heads, head_dim]: bf16 (uint16_t) or, with int8, int8_t
  const void* v_pool;
  const float* k_scale = nullptr;  // int8 pools: [num_slots, num_kv_heads] fp32 (value = q · scale); else null
  const float* v_scale = nullptr;
  bool int8 = false;
  int64_t num_heads, num_kv_heads, head_dim;  // head_dim a multiple of 16; num_heads % num_kv_heads == 0
  const int64_t* slots;     // every segment's context slots back to back
  const int64_t* segments;  // [n, 4]: (query_start, num_new, num_cached, slot_offset)
  int64_t num_segments;
  // per segment (may be null: nothing shared): its leader and how many of its first positions
  // (a multiple of 64, the leader's slots) it reads from the leader's packed K/V instead of its own
  const int64_t* leader = nullptr;
  const int64_t* shared_len = nullptr;
  float scale;  // > 0
  float softcap = 0.f;  // > 0: each scaled score capped to softcap·tanh(score / softcap) first (Gemma 2)
};

// Probabilities are those of a softmax in fp32 over the scaled scores (online, per block of 32
// keys), each rounded to bf16 before it weights its V row (for int8 pools: times the key's V
// scale, then rounded); the K scale multiplies a key's score first. The output is rounded to bf16
// once. A query row's bits depend only on its own query, its context and its position, not on
// the other rows in the call or how its prompt was split into chunks.
void paged_prefill_attention(const PrefillAttentionArgs& args);

}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
