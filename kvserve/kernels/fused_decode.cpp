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
// A mixture of experts' sparse layer (DecodeLayer.moe) runs one token's routed experts by
// moe_token (and its shared expert), so such a model's step is fused at batch 1 only: larger
// batches group their tokens by expert (model/moe.py), layer by layer. OLMoE's q/k norms over
// the whole projections are its kernel here too (whole_projection_norm).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <utility>

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

// OLMoE's q/k norms over the whole Q and whole K projection: model/llama.py
// WholeProjectionNorm's kernel call (one process: no AllReduce, each KV head once), so the
// fused step and the layer-by-layer one agree bitwise.
at::Tensor norm_whole(const at::Tensor& qkv, const DecodeLayer& layer, int64_t q_size, int64_t kv_size, double eps) {
  return whole_projection_norm(qkv, layer.q_norm, layer.k_norm, q_size, kv_size, static_cast<double>(q_size),
                               static_cast<double>(kv_size), eps, c10::nullopt);
}

// One token's float (bf16) experts: model/moe.py route() and _one_token, the same ops in the
// same order (the experts in index order, each a SiLU MLP on its projections, weighted into
// an fp32 sum): (out [1, d] fp32, the experts run in index order).
std::tuple<at::Tensor, at::Tensor> float_experts(const at::Tensor& x, const DecodeMoe& moe) {
  auto [weights, chosen] = moe_route(x.contiguous(), moe.router, moe.top_k, moe.norm_topk_prob);
  std::vector<std::pair<int64_t, float>> pairs;
  for (int64_t j = 0; j < moe.top_k; ++j) pairs.emplace_back(chosen.data_ptr<int64_t>()[j], weights.data_ptr<float>()[j]);
  std::sort(pairs.begin(), pairs.end());
  at::Tensor out = at::zeros({1, x.size(1)}, x.options().dtype(at::kFloat));
  at::Tensor sorted = at::empty({moe.top_k}, chosen.options());
  for (int64_t j = 0; j < moe.top_k; ++j) {
    const auto [e, w] = pairs[j];
    sorted.data_ptr<int64_t>()[j] = e;
    const at::Tensor y = linear(linear_silu_mul(x, moe.expert_gate_up[e]), moe.expert_down[e]);
    out.add_(y.to(at::kFloat).mul(static_cast<double>(w)));  // a double scalar, as Python passes its float
  }
  return {out, sorted};
}

// A sparse layer's FFN for one token: model/moe.py SparseMoE.forward's batch-1 path (moe_token
// for quantized experts, else _one_token's; then _add_shared), the same calls in the same order;
// the experts run are left in moe.chosen for the Python side's counts.
at::Tensor sparse_ffn(const at::Tensor& x, DecodeMoe& moe) {
  auto [out, chosen] = moe.experts.gate_up.empty() ? float_experts(x, moe)
                                                   : moe_token(x, moe.router, moe.experts, moe.top_k, moe.norm_topk_prob);
  moe.chosen.assign(chosen.data_ptr<int64_t>(), chosen.data_ptr<int64_t>() + chosen.numel());
  if (moe.shared_gate.defined()) {
    const at::Tensor gate = at::sigmoid(at::linear(x.to(at::kFloat), moe.shared_gate));
    out.add_(gate.mul(linear(linear_silu_mul(x, moe.shared_gate_up), moe.shared_down).to(at::kFloat)));
  }
  return out.to(x.scalar_type());
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
    TORCH_CHECK(!layer.moe || h.size(0) == 1, "decode_layers: a sparse layer runs one token (moe_token), got a batch of ",
                h.size(0));
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
    if (layer.qk_norm_whole) qkv = norm_whole(qkv, layer, num_heads * head_dim, num_kv_heads * head_dim, eps);
    else if (layer.q_norm.defined()) norm_heads_(qkv, layer, num_heads, num_kv_heads, head_dim, eps);
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
    if (layer.moe)
      h = sparse_ffn(x, *layer.moe);
    else
      h = linear(layer.gelu ? gelu_tanh_and_mul(linear(x, layer.gate_up)) : linear_silu_mul(x, layer.gate_up), layer.down);
    if (layer.mlp_out_norm.defined()) h = rms_norm(h, layer.mlp_out_norm, eps, c10::nullopt);
  }
  return residual.add_(h);
}
