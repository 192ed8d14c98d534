// A whole decode step's layers in one call. Every decoder layer for a batch of decode tokens
// (one new position per request, bf16): the same kernels the Python layer calls, in the same
// order, without returning to Python between them. At batch 1 the ~300 Python-level calls of
// a step cost as much as a third of the weight-streaming time; at batch 64 they are still ~5%
// of the step. This is the CPU's answer to what CUDA graphs do for launch overhead. The
// projections go through linear() / linear_silu_mul() on each layer's Projections (see
// kernels.h), as the Python layers do, so which kernel a batch size gets is decided there.
// bf16 or int8 KV pools: with int8 ones the model carries their scales (DecodeModel.k_scales).
// A shared-prefix plan (`shared_prefix`) replaces each layer's decode attention by
// shared_prefix_decode_attention, so reading a prefix once per group does not cost the step its
// single call.
#include <ATen/core/Tensor.h>

#include "kernels.h"

namespace {

// Qwen3's q/k norm: rms_norm over each query and key head of the QKV output, in place (V is
// left as it is). The same rms_norm rows, in the same layout, as the Python layer
// (model/llama.py norm_heads_), so the fused step and the layer-by-layer one agree bitwise.
void norm_heads_(at::Tensor& qkv, const DecodeLayer& layer, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 double eps) {
  const int64_t T = qkv.size(0);
  at::Tensor heads = qkv.view({T, num_heads + 2 * num_kv_heads, head_dim});
  for (int part = 0; part < 2; ++part) {
    const int64_t first = part == 0 ? 0 : num_heads, count = part == 0 ? num_heads : num_kv_heads;
    at::Tensor rows = heads.narrow(1, first, count);
    rows.copy_(rms_norm(rows.reshape({T * count, head_dim}), part == 0 ? layer.q_norm : layer.k_norm, eps, c10::nullopt)
                   .view({T, count, head_dim}));
  }
}

}  // namespace

at::Tensor decode_layers(const DecodeModel& model, at::Tensor h, at::Tensor positions, at::Tensor slot_mapping,
                         at::Tensor block_tables, at::Tensor context_lens, const SharedPrefixDecodePlan* shared_prefix) {
  TORCH_CHECK(model.k_pools.size() == model.layers.size() && model.v_pools.size() == model.layers.size(),
              "decode_layers: one K and one V pool per layer, got ", model.layers.size(), " layers, ",
              model.k_pools.size(), " K and ", model.v_pools.size(), " V pools");
  // int8 pools: one K and one V scale pool per layer beside them (empty for float pools)
  const bool int8 = !model.k_scales.empty() || !model.v_scales.empty();
  TORCH_CHECK(!int8 || (model.k_scales.size() == model.layers.size() && model.v_scales.size() == model.layers.size()),
              "decode_layers: int8 pools need one K and one V scale pool per layer, got ", model.k_scales.size(), " and ",
              model.v_scales.size(), " for ", model.layers.size(), " layers");
  const int64_t B = h.size(0);
  const int64_t num_heads = model.num_heads, num_kv_heads = model.num_kv_heads, head_dim = model.head_dim;
  const double eps = model.eps;
  at::Tensor residual;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    const DecodeLayer& layer = model.layers[l];
    at::Tensor x = residual.defined() ? rms_norm(h, layer.input_norm, eps, residual)
                                      : rms_norm(h, layer.input_norm, eps, c10::nullopt);
    if (!residual.defined()) residual = h;
    at::Tensor qkv = linear(x, layer.qkv);
    if (layer.q_norm.defined()) norm_heads_(qkv, layer, num_heads, num_kv_heads, head_dim, eps);
    at::Tensor q, attn;
    c10::optional<at::Tensor> k_scale, v_scale;
    if (int8) {
      k_scale = model.k_scales[l];
      v_scale = model.v_scales[l];
      q = rope_and_cache_int8(qkv, positions, model.cos_half, model.sin_half, model.k_pools[l], model.v_pools[l],
                              model.k_scales[l], model.v_scales[l], slot_mapping, num_heads, num_kv_heads, head_dim);
    } else {
      q = rope_and_cache(qkv, positions, model.cos_half, model.sin_half, model.k_pools[l], model.v_pools[l],
                         slot_mapping, num_heads, num_kv_heads, head_dim);
    }
    if (shared_prefix)
      attn = shared_prefix_decode_attention(q, model.k_pools[l], model.v_pools[l], block_tables, context_lens, *shared_prefix,
                                      model.scale, k_scale, v_scale);
    else
      attn = paged_decode_attention(q, model.k_pools[l], model.v_pools[l], block_tables, context_lens, model.scale,
                                    k_scale, v_scale);
    at::Tensor o = linear(attn.view({B, num_heads * head_dim}), layer.o);
    x = rms_norm(o, layer.post_attention_norm, eps, residual);
    h = linear(linear_silu_mul(x, layer.gate_up), layer.down);
  }
  return residual.add_(h);
}
