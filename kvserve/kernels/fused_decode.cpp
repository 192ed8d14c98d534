// A whole decode step's layers in one call. Every decoder layer for a batch of decode tokens
// (one new position per request, bf16): the same kernels the Python layer calls, in the same
// order, without returning to Python between them. At batch 1 the ~300 Python-level calls of
// a step cost as much as a third of the weight-streaming time; at batch 64 they are still ~5%
// of the step. This is the CPU's answer to what CUDA graphs do for launch overhead. The
// projections go through linear() / linear_silu_mul() on each layer's Projections (see
// kernels.h), as the Python layers do, so which kernel a batch size gets is decided there.
// bf16 or int8 KV pools: with int8 ones the model carries their scales (DecodeModel.k_scales).
// A shared-prefix plan (`shared_prefixes`, one per KV group, over that group's blocks) replaces
// each layer's decode attention by shared_prefix_decode_attention, so reading a prefix once per
// group of requests does not cost the step its single call. Gemma's layer is the same layer with options (DecodeLayer): a norm on each
// branch's output before the residual add, GeGLU for SwiGLU, the local layers' own RoPE tables
// and KV group (each group's layers index its own slots and blocks). A layer whose sliding
// window some row of the step sees past (`window_starts`) reads each row's last W positions
// through the decode kernel's ranged form, as attention/sliding_window.py does layer by layer.
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
    // contiguous: with one KV head the key rows are a strided view (as model/llama.py makes them too)
    rows.copy_(rms_norm(rows.reshape({T * count, head_dim}).contiguous(), part == 0 ? layer.q_norm : layer.k_norm, eps, c10::nullopt)
                   .view({T, count, head_dim}));
  }
}

}  // namespace

at::Tensor decode_layers(const DecodeModel& model, at::Tensor h, at::Tensor positions,
                         const std::vector<at::Tensor>& slot_mappings, const std::vector<at::Tensor>& block_tables,
                         at::Tensor context_lens, const std::vector<const SharedPrefixDecodePlan*>& shared_prefixes,
                         const std::vector<c10::optional<at::Tensor>>& window_starts) {
  TORCH_CHECK(model.k_pools.size() == model.layers.size() && model.v_pools.size() == model.layers.size(),
              "decode_layers: one K and one V pool per layer, got ", model.layers.size(), " layers, ",
              model.k_pools.size(), " K and ", model.v_pools.size(), " V pools");
  // int8 pools: one K and one V scale pool per layer beside them (empty for float pools)
  const bool int8 = !model.k_scales.empty() || !model.v_scales.empty();
  TORCH_CHECK(!int8 || (model.k_scales.size() == model.layers.size() && model.v_scales.size() == model.layers.size()),
              "decode_layers: int8 pools need one K and one V scale pool per layer, got ", model.k_scales.size(), " and ",
              model.v_scales.size(), " for ", model.layers.size(), " layers");
  TORCH_CHECK(!slot_mappings.empty() && slot_mappings.size() == block_tables.size(),
              "decode_layers: one slot mapping and one block table per KV group, got ", slot_mappings.size(), " and ",
              block_tables.size());
  TORCH_CHECK(shared_prefixes.empty() || shared_prefixes.size() == slot_mappings.size(),
              "decode_layers: shared-prefix plans index one KV group's blocks each: none, or one entry per group (None "
              "where a group has no plan), got ", shared_prefixes.size(), " for ", slot_mappings.size(), " groups");
  TORCH_CHECK(window_starts.empty() || window_starts.size() == model.layers.size(),
              "decode_layers: window_starts holds one entry per layer or none, got ", window_starts.size(), " for ",
              model.layers.size(), " layers");
  for (const DecodeLayer& layer : model.layers) {
    TORCH_CHECK(layer.kv_group >= 0 && layer.kv_group < static_cast<int64_t>(slot_mappings.size()),
                "decode_layers: a layer of KV group ", layer.kv_group, " in a step of ", slot_mappings.size(), " groups");
    TORCH_CHECK(!layer.local || model.cos_local.defined(), "decode_layers: a local layer in a model without local RoPE tables");
  }
  const int64_t B = h.size(0);
  const int64_t num_heads = model.num_heads, num_kv_heads = model.num_kv_heads, head_dim = model.head_dim;
  const double eps = model.eps;
  at::Tensor residual;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    const DecodeLayer& layer = model.layers[l];
    const at::Tensor& slot_mapping = slot_mappings[layer.kv_group];
    const at::Tensor& tables = block_tables[layer.kv_group];
    const at::Tensor& cos = layer.local ? model.cos_local : model.cos_half;
    const at::Tensor& sin = layer.local ? model.sin_local : model.sin_half;
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
      q = rope_and_cache_int8(qkv, positions, cos, sin, model.k_pools[l], model.v_pools[l], model.k_scales[l],
                              model.v_scales[l], slot_mapping, num_heads, num_kv_heads, head_dim);
    } else {
      q = rope_and_cache(qkv, positions, cos, sin, model.k_pools[l], model.v_pools[l], slot_mapping, num_heads,
                         num_kv_heads, head_dim);
    }
    // the order of attention/paged.py: a window seen past first (it hides the positions a
    // shared-prefix plan would read), then the plan, then the plain kernel
    const bool windowed = !window_starts.empty() && window_starts[l].has_value();
    if (windowed)
      attn = std::get<0>(paged_decode_attention_lse(q, model.k_pools[l], model.v_pools[l], tables, context_lens,
                                                    *window_starts[l], model.scale, k_scale, v_scale, model.softcap))
                 .to(q.scalar_type());
    else if (const SharedPrefixDecodePlan* plan = shared_prefixes.empty() ? nullptr : shared_prefixes[layer.kv_group])
      attn = shared_prefix_decode_attention(q, model.k_pools[l], model.v_pools[l], tables, context_lens, *plan,
                                            model.scale, k_scale, v_scale, model.softcap);
    else
      attn = paged_decode_attention(q, model.k_pools[l], model.v_pools[l], tables, context_lens, model.scale, k_scale,
                                    v_scale, model.softcap);
    at::Tensor o = linear(attn.view({B, num_heads * head_dim}), layer.o);
    if (layer.attn_out_norm.defined()) o = rms_norm(o, layer.attn_out_norm, eps, c10::nullopt);
    x = rms_norm(o, layer.post_attention_norm, eps, residual);
    h = linear(layer.gelu ? gelu_tanh_and_mul(linear(x, layer.gate_up)) : linear_silu_mul(x, layer.gate_up), layer.down);
    if (layer.mlp_out_norm.defined()) h = rms_norm(h, layer.mlp_out_norm, eps, c10::nullopt);
  }
  return residual.add_(h);
}
