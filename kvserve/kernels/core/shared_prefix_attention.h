// Shared-prefix decode attention, torch-free (the core of
// kernels.h's shared_prefix_attention, merge_attention_states and merge_attention_row).
//
// The n query rows of a group whose block tables start with the same prefix blocks attend to
// those blocks' first prefix_len positions together, non-causally: each K/V row of a KV head is
// read once for all n·g query rows of that head (a small matrix product with the query rows
// in vector lanes). Arithmetic:
//   score = (q·k summed in fp32, features in order; at the bf16 pair-dot levels feature
//            pairs in order) · scale   (int8: · k_scale · scale); with a softcap,
//            softcap · tanh(score / softcap) (simd::softcap8)
//   per chunk of kChunk positions: max, e^(score - max) (simd::exp8), Σ of the fp32 e, and
//   P = e rounded to bf16 (int8: e · v_scale, then rounded) times V in fp32, positions in order
//   (pair levels: positions in pairs, in order);
//   the chunks of a row merged in order: out = Σ w·acc / Σ w·sum, lse = max + log Σ.
// Every row's lane runs the same operations whatever the other rows of the group, and the
// chunk split depends on prefix_len only: a row's result does not depend on the group (bitwise).
#pragma once
#include <cstdint>

#include "simd.h"

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace shared_prefix {

constexpr int64_t kChunk = 256;       // positions per task (a multiple of 8)
constexpr int64_t kMaxHeadDim = 256;  // kernels.h kDecodeAttentionMaxHeadDim

struct Args {
  const uint16_t* q = nullptr;  // [n, N_q, H] bf16
  bool int8 = false;            // pools int8 (with scales) or bf16 (uint16_t)
  const void* k_pool = nullptr;  // [num_blocks, block_size, N_kv, H]
  const void* v_pool = nullptr;
  const float* k_scale = nullptr;  // int8 only: [num_blocks, block_size, N_kv]
  const float* v_scale = nullptr;
  const int32_t* blocks = nullptr;  // [P], P·block_size >= prefix_len
  int64_t prefix_len = 0;
  int64_t n = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, block_size = 0;
  float scale = 1.f;
  float softcap = 0.f;  // > 0: scores capped to softcap·tanh(score / softcap) before the softmax (Gemma 2)
  float* out = nullptr;  // [n, N_q, H] fp32, normalised
  float* lse = nullptr;  // [n, N_q] fp32
};

// head_dim a multiple of 16 (32 in practice) and <= kMaxHeadDim, num_heads % num_kv_heads == 0.
// prefix_len 0 gives out 0 and lse -inf.
void shared_prefix_attention(const Args& a);

// (xa, la) and (xb, lb) -> dst (fp32 dst_f32 or bf16 dst_bf16; dst may be xa) and *lse_out:
// (xa·e^(la - m) + xb·e^(lb - m)) / (e^(la - m) + e^(lb - m)), m = max(la, lb); a part with lse
// -inf has no weight (its output is never read), both -inf give 0 and -inf. H a multiple of 8.
void merge_attention_row(const float* xa, float la, const float* xb, float lb, int64_t H, float* dst_f32,
                         uint16_t* dst_bf16, float* lse_out);

// merge_attention_row over `rows` rows of H (contiguous), OpenMP over rows
void merge_attention_states(const float* xa, const float* la, const float* xb, const float* lb, int64_t rows,
                            int64_t H, float* dst_f32, uint16_t* dst_bf16, float* lse_out);

}  // namespace shared_prefix
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
