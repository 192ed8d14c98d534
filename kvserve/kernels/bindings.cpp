// The Python module (kvserve.kernels.cpu_ops()): every kernel kernels.h declares, the
// decode step's Projection / DecodeLayer / DecodeModel, and limits(). Declared, typed, in
// kvserve/kernels/api.py (tests/kernels/test_bindings.py keeps the two in step). Tensors a
// Projection may lack are None in Python and undefined in C++.
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

namespace {

using MaybeTensor = c10::optional<at::Tensor>;

at::Tensor or_undefined(const MaybeTensor& t) { return t ? *t : at::Tensor(); }

// a readable attribute that is None for an undefined tensor
template <typename Class>
auto maybe(at::Tensor Class::*field) {
  return [field](const Class& self) -> MaybeTensor {
    const at::Tensor& t = self.*field;
    return t.defined() ? MaybeTensor(t) : c10::nullopt;
  };
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa_level", [] { return std::string(KVSERVE_LEVEL_NAME); }, "the ISA level this build was compiled for");
  m.def(
      "families",
      [] {
        py::dict out;
        for (const auto& [family, level] : kernel_families()) out[py::str(family)] = level;
        return out;
      },
      "the kernel families this build runs, each with the level its code is compiled at");
  m.def("amx_available", &amx_available, "AMX-BF16 present and granted to this process");
  m.def("amx_pack_weight", &amx_pack_weight, "[N, K] bf16 weight -> AMX VNNI tiles");
  m.def("bf16_tile_rows", &bf16_tile_rows, "rows ids of the weight amx_pack_weight packed -> [T, K] bf16",
        py::arg("tiles"), py::arg("ids"));
  m.def("amx_linear_silu_mul", &amx_linear_silu_mul,
        "silu(x @ gate.T) * (x @ up.T) on AMX tiles, gate/up packed with their 16-column blocks interleaved");
  m.def("amx_linear", &amx_linear, "y = x @ w.T (+ bias) on AMX tiles", py::arg("x"), py::arg("packed"),
        py::arg("bias") = py::none());
  m.def("amx_linear_argmax", &amx_linear_argmax,
        "argmax over each row of x @ w.T (+ bias) rounded to bf16, without writing the product (at most 128 rows)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("argmax_rows", &argmax_rows, "row-wise argmax, ties to the lowest index");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after residual += x (in place)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("rope_and_cache", &rope_and_cache, "RoPE on Q and K, K/V written to their slots; returns Q");
  m.def("rope_and_cache_int8", &rope_and_cache_int8,
        "RoPE on Q and K, K/V quantized into int8 pools with a scale per (slot, KV head); returns Q");
  m.def("qk_sum_squares", &qk_sum_squares, "each QKV row's (sum of q squared, sum of k squared) in fp32",
        py::arg("qkv"), py::arg("q_size"), py::arg("kv_size"));
  m.def("whole_projection_norm", &whole_projection_norm,
        "RMSNorm over the whole Q and the whole K projection of each QKV row (V as it is), from `sums` or the row's own",
        py::arg("qkv"), py::arg("q_weight"), py::arg("k_weight"), py::arg("q_size"), py::arg("kv_size"),
        py::arg("q_width"), py::arg("k_width"), py::arg("eps"), py::arg("sums") = py::none());
  m.def("moe_route", &moe_route, "each token's top-k experts by its fp32 router softmax: (weights, experts)",
        py::arg("x"), py::arg("router"), py::arg("top_k"), py::arg("norm_topk_prob"));
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up");
  m.def("gemv_bf16", &gemv_bf16, "y = x @ w.T for small M, bf16");
  m.def("gemv_vnni", &gemv_vnni, "y = x @ w.T for small M, bf16, on amx_pack_weight(w)");
  m.def("set_bf16_pair_dots", &set_bf16_pair_dots,
        "the bf16 GEMM by VDPBF16PS pair dots (True) or widened fp32 FMAs (False), for every later call; returns "
        "what is in effect (always False at a level without pair dots)", py::arg("on"));
  m.def("bf16_pair_dots", &bf16_pair_dots, "whether the bf16 GEMM on the VNNI tiles takes VDPBF16PS pair dots");
  m.def("gemm_vnni", &gemm_vnni, "y = x @ w.T for any M, bf16, on amx_pack_weight(w)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged KV pool (int8 pools with their scales)", py::arg("q"), py::arg("k_pool"),
        py::arg("v_pool"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("softcap") = 0.0);
  m.def("paged_decode_attention_lse", &paged_decode_attention_lse,
        "decode attention over positions [start, len) of each row: (out fp32, lse fp32)", py::arg("q"), py::arg("k_pool"),
        py::arg("v_pool"), py::arg("block_tables"), py::arg("context_lens"), py::arg("start_positions"), py::arg("scale"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("softcap") = 0.0);
  m.def("shared_prefix_attention", &shared_prefix_attention,
        "a group's queries against its shared prefix blocks, each read once: (out fp32, lse fp32)", py::arg("q"),
        py::arg("k_pool"), py::arg("v_pool"), py::arg("prefix_blocks"), py::arg("prefix_len"), py::arg("scale"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("softcap") = 0.0);
  m.def("merge_attention_states", &merge_attention_states,
        "two attention parts merged through their log-sum-exp: (out in out_dtype, lse fp32)", py::arg("out_a"),
        py::arg("lse_a"), py::arg("out_b"), py::arg("lse_b"), py::arg("out_dtype"));
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of prompt tokens over the paged KV pool on AMX tiles, into out (int8 pools with their scales)",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("slots"), py::arg("segments"), py::arg("scale"),
        py::arg("out"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("shared") = py::none(),
        py::arg("softcap") = 0.0);
  m.def(
      "limits",
      [] {
        py::dict limits;
        for (const KernelLimit& limit : kKernelLimits) limits[limit.key] = limit.value;
        return limits;
      },
      "every shape limit the kernels enforce, by name (see kernels.h)");
  m.def("linear", &linear, "y = x @ W.T (+ b) by the rows of x, on the projection's copies of W", py::arg("x"),
        py::arg("projection"));
  m.def("linear_silu_mul", &linear_silu_mul, "silu(gate) * up of a [gate; up] projection of x", py::arg("x"),
        py::arg("projection"));
  m.def("decode_layers", &decode_layers,
        "every decoder layer of a decode batch in one call; the residual stream after the last (before the final norm)",
        py::arg("model"), py::arg("h"), py::arg("positions"), py::arg("slot_mappings"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("shared_prefixes") = std::vector<const SharedPrefixDecodePlan*>(),
        py::arg("window_starts") = std::vector<c10::optional<at::Tensor>>());
  m.def("shared_prefix_decode_attention", &shared_prefix_decode_attention,
        "decode attention in parts by a shared-prefix plan (suffixes, then each level read once), merged in place",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("plan"), py::arg("scale"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("softcap") = 0.0);

  m.def("quant_linear", &quant_linear, "y = x @ W.T (+ bias) on block-quantized segments (int8 dot products)",
        py::arg("x"), py::arg("segments"), py::arg("bias") = py::none(), py::arg("float_out") = false);
  m.def("quant_linear_rows", &quant_linear_rows, "y[r] = x[r] @ W_r.T, each row its own block-quantized weight",
        py::arg("x"), py::arg("per_row"), py::arg("float_out") = false);
  py::class_<MoeExperts>(m, "MoeExperts", py::module_local(), "a layer's routed experts' quantized segments (kernels.h)")
      .def(py::init([](const std::vector<std::vector<QuantSegment>>& gate_up,
                       const std::vector<std::vector<QuantSegment>>& down, bool float_out) {
             TORCH_CHECK(gate_up.size() == down.size(), "MoeExperts: ", gate_up.size(), " [gate; up] for ", down.size(), " downs");
             return MoeExperts{gate_up, down, float_out};
           }),
           py::arg("gate_up"), py::arg("down"), py::arg("float_out") = false);
  m.def("moe_token", &moe_token, "one token's routed experts: route, [gate; up], silu, down, the weighted sum",
        py::arg("x"), py::arg("router"), py::arg("experts"), py::arg("top_k"), py::arg("norm_topk_prob"));
  m.def("quant_embedding", &quant_embedding, "rows `ids` of the block-quantized W, dequantized", py::arg("ids"),
        py::arg("segments"), py::arg("in_features"), py::arg("dtype"));
  m.attr("QUANT_Q8") = kQuantQ8;
  m.attr("QUANT_Q4") = kQuantQ4;
  m.attr("QUANT_Q4_MIN") = kQuantQ4Min;
  m.attr("QUANT_Q8_MIN") = kQuantQ8Min;
  m.attr("QUANT_Q4_K") = kQuantQ4K;
  m.attr("QUANT_Q6_K") = kQuantQ6K;

  py::class_<QuantSegment>(m, "QuantSegment", py::module_local(), "output columns of one block-quantized format (kernels.h)")
      .def(py::init([](const at::Tensor& codes, const at::Tensor& scales, const MaybeTensor& mins, int64_t format,
                       const MaybeTensor& sub) { return QuantSegment{codes, scales, or_undefined(mins), format, or_undefined(sub)}; }),
           py::kw_only(), py::arg("codes"), py::arg("scales"), py::arg("mins") = py::none(), py::arg("format"),
           py::arg("sub") = py::none())
      .def_readonly("codes", &QuantSegment::codes)
      .def_readonly("scales", &QuantSegment::scales)
      .def_property_readonly("mins", maybe(&QuantSegment::mins))
      .def_property_readonly("sub", maybe(&QuantSegment::sub))
      .def_readonly("format", &QuantSegment::format);

  py::class_<Projection>(m, "Projection", py::module_local(), "one projection y = x @ W.T (+ b) as its kernels read it (kernels.h)")
      .def(py::init([](const MaybeTensor& weight, const MaybeTensor& gemv, const MaybeTensor& amx, const MaybeTensor& onednn,
                       const MaybeTensor& bias, int64_t gemv_max_rows, int64_t amx_max_rows, bool silu_interleaved,
                       bool gemv_all_rows, const std::vector<QuantSegment>& quant, bool float_out) {
             return Projection{or_undefined(weight), or_undefined(gemv), or_undefined(amx), or_undefined(onednn),
                               or_undefined(bias), gemv_max_rows, amx_max_rows, silu_interleaved, gemv_all_rows, quant,
                               float_out};
           }),
           py::kw_only(), py::arg("weight") = py::none(), py::arg("gemv") = py::none(), py::arg("amx") = py::none(),
           py::arg("onednn") = py::none(), py::arg("bias") = py::none(), py::arg("gemv_max_rows") = 0,
           py::arg("amx_max_rows") = 0, py::arg("silu_interleaved") = false, py::arg("gemv_all_rows") = false,
           py::arg("quant") = std::vector<QuantSegment>(), py::arg("float_out") = false)
      .def_readonly("float_out", &Projection::float_out)
      .def_readonly("gemv_all_rows", &Projection::gemv_all_rows)
      .def_readonly("quant", &Projection::quant)
      .def_property_readonly("weight", maybe(&Projection::weight))
      .def_property_readonly("gemv", maybe(&Projection::gemv))
      .def_property_readonly("amx", maybe(&Projection::amx))
      .def_property_readonly("onednn", maybe(&Projection::onednn))
      .def_property_readonly("bias", maybe(&Projection::bias))
      .def_readonly("gemv_max_rows", &Projection::gemv_max_rows)
      .def_readonly("amx_max_rows", &Projection::amx_max_rows)
      .def_readonly("silu_interleaved", &Projection::silu_interleaved);

  py::class_<DecodeMoe, std::shared_ptr<DecodeMoe>>(m, "DecodeMoe", py::module_local(),
                                                    "a sparse layer's routed experts (and shared expert), for decode_layers")
      .def(py::init([](at::Tensor router, int64_t top_k, bool norm_topk_prob, c10::optional<MoeExperts> experts, std::vector<Projection> expert_gate_up,
                       std::vector<Projection> expert_down, c10::optional<Projection> shared_gate_up,
                       c10::optional<Projection> shared_down, c10::optional<at::Tensor> shared_gate) {
             TORCH_CHECK(experts.has_value() != !expert_gate_up.empty() && expert_gate_up.size() == expert_down.size(),
                         "DecodeMoe: the experts as quantized segments (experts) or as float projections "
                         "(expert_gate_up and expert_down, one each per expert), not both");
             const int64_t E = static_cast<int64_t>(experts ? experts->gate_up.size() : expert_gate_up.size());
             TORCH_CHECK(router.dim() == 2 && router.size(0) == E && router.scalar_type() == at::kFloat,
                         "DecodeMoe: the router must be fp32 [experts, d] with one row per expert");
             TORCH_CHECK(0 < top_k && top_k <= E, "DecodeMoe: top_k ", top_k, " of ", E, " experts");
             TORCH_CHECK(shared_gate_up.has_value() == shared_gate.has_value() && shared_down.has_value() == shared_gate.has_value(),
                         "DecodeMoe: a shared expert needs its gate_up, down and gate together");
             return std::make_shared<DecodeMoe>(DecodeMoe{router, experts.value_or(MoeExperts()), std::move(expert_gate_up),
                                                          std::move(expert_down), top_k, norm_topk_prob,
                                                          shared_gate_up.value_or(Projection()),
                                                          shared_down.value_or(Projection()),
                                                          shared_gate.value_or(at::Tensor()), {}});
           }),
           py::kw_only(), py::arg("router"), py::arg("top_k"), py::arg("norm_topk_prob"), py::arg("experts") = py::none(), py::arg("expert_gate_up") = std::vector<Projection>(),
           py::arg("expert_down") = std::vector<Projection>(), py::arg("shared_gate_up") = py::none(),
           py::arg("shared_down") = py::none(), py::arg("shared_gate") = py::none())
      .def_readonly("router", &DecodeMoe::router)
      .def_readonly("top_k", &DecodeMoe::top_k)
      .def_readonly("norm_topk_prob", &DecodeMoe::norm_topk_prob)
      .def_readonly("chosen", &DecodeMoe::chosen)
      .def_property_readonly("shared_gate", maybe(&DecodeMoe::shared_gate));

  py::class_<DecodeLayer>(m, "DecodeLayer", py::module_local(), "one decoder layer's norms and projections, for decode_layers")
      .def(py::init([](at::Tensor input_norm, at::Tensor post_attention_norm, Projection qkv, Projection o,
                       c10::optional<Projection> gate_up, c10::optional<Projection> down, c10::optional<at::Tensor> q_norm,
                       c10::optional<at::Tensor> k_norm, c10::optional<at::Tensor> attn_out_norm,
                       c10::optional<at::Tensor> mlp_out_norm, bool gelu, bool local, int64_t kv_group,
                       std::shared_ptr<DecodeMoe> moe, bool qk_norm_whole) {
             TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecodeLayer: q_norm and k_norm come together");
             TORCH_CHECK(!qk_norm_whole || q_norm.has_value(), "DecodeLayer: qk_norm_whole needs q_norm and k_norm");
             TORCH_CHECK(moe ? !gate_up && !down && !gelu : gate_up && down,
                         "DecodeLayer: a dense layer needs gate_up and down, a sparse one (moe) neither");
             TORCH_CHECK(!gelu || !gate_up->silu_interleaved, "DecodeLayer: a GeGLU layer needs the plain [gate; up] projection");
             return DecodeLayer{input_norm, post_attention_norm, q_norm.value_or(at::Tensor()), k_norm.value_or(at::Tensor()),
                                qk_norm_whole, qkv, o, gate_up.value_or(Projection()), down.value_or(Projection()),
                                std::move(moe), attn_out_norm.value_or(at::Tensor()),
                                mlp_out_norm.value_or(at::Tensor()), gelu, local, kv_group};
           }),
           py::kw_only(), py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up") = py::none(), py::arg("down") = py::none(), py::arg("q_norm") = py::none(),
           py::arg("k_norm") = py::none(), py::arg("attn_out_norm") = py::none(), py::arg("mlp_out_norm") = py::none(),
           py::arg("gelu") = false, py::arg("local") = false, py::arg("kv_group") = 0, py::arg("moe") = py::none(),
           py::arg("qk_norm_whole") = false)
      .def_readonly("input_norm", &DecodeLayer::input_norm)
      .def_readonly("post_attention_norm", &DecodeLayer::post_attention_norm)
      .def_property_readonly("q_norm", maybe(&DecodeLayer::q_norm))
      .def_property_readonly("k_norm", maybe(&DecodeLayer::k_norm))
      .def_readonly("qkv", &DecodeLayer::qkv)
      .def_readonly("o", &DecodeLayer::o)
      .def_readonly("gate_up", &DecodeLayer::gate_up)
      .def_readonly("down", &DecodeLayer::down)
      .def_property_readonly("attn_out_norm", maybe(&DecodeLayer::attn_out_norm))
      .def_property_readonly("mlp_out_norm", maybe(&DecodeLayer::mlp_out_norm))
      .def_readonly("gelu", &DecodeLayer::gelu)
      .def_readonly("local", &DecodeLayer::local)
      .def_readonly("kv_group", &DecodeLayer::kv_group)
      .def_readonly("moe", &DecodeLayer::moe)
      .def_readonly("qk_norm_whole", &DecodeLayer::qk_norm_whole);

  py::class_<DecodeModel>(m, "DecodeModel", py::module_local(), "every layer, the KV pools and the shapes decode_layers runs on")
      .def(py::init([](std::vector<DecodeLayer> layers, std::vector<at::Tensor> k_pools, std::vector<at::Tensor> v_pools,
                       at::Tensor cos_half, at::Tensor sin_half, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, double eps, double scale, std::vector<at::Tensor> k_scales,
                       std::vector<at::Tensor> v_scales, c10::optional<at::Tensor> cos_local,
                       c10::optional<at::Tensor> sin_local, double softcap) {
             TORCH_CHECK(softcap >= 0, "DecodeModel: softcap must be >= 0 (0: none), got ", softcap);
             TORCH_CHECK(cos_local.has_value() == sin_local.has_value(), "DecodeModel: cos_local and sin_local come together");
             return DecodeModel{std::move(layers), std::move(k_pools), std::move(v_pools), cos_half, sin_half, num_heads,
                                num_kv_heads, head_dim, eps, scale, std::move(k_scales), std::move(v_scales),
                                cos_local.value_or(at::Tensor()), sin_local.value_or(at::Tensor()), softcap};
           }),
           py::kw_only(), py::arg("layers"), py::arg("k_pools"), py::arg("v_pools"), py::arg("cos_half"),
           py::arg("sin_half"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("scale"), py::arg("k_scales") = std::vector<at::Tensor>(),
           py::arg("v_scales") = std::vector<at::Tensor>(), py::arg("cos_local") = py::none(),
           py::arg("sin_local") = py::none(), py::arg("softcap") = 0.0)
      .def_readonly("layers", &DecodeModel::layers)
      .def_readonly("k_pools", &DecodeModel::k_pools)
      .def_readonly("v_pools", &DecodeModel::v_pools)
      .def_readonly("cos_half", &DecodeModel::cos_half)
      .def_readonly("sin_half", &DecodeModel::sin_half)
      .def_readonly("num_heads", &DecodeModel::num_heads)
      .def_readonly("num_kv_heads", &DecodeModel::num_kv_heads)
      .def_readonly("head_dim", &DecodeModel::head_dim)
      .def_readonly("eps", &DecodeModel::eps)
      .def_readonly("scale", &DecodeModel::scale)
      .def_readonly("k_scales", &DecodeModel::k_scales)
      .def_readonly("v_scales", &DecodeModel::v_scales)
      .def_property_readonly("cos_local", maybe(&DecodeModel::cos_local))
      .def_property_readonly("sin_local", maybe(&DecodeModel::sin_local))
      .def_readonly("softcap", &DecodeModel::softcap);

  py::class_<SharedPrefixLevel>(m, "SharedPrefixLevel", py::module_local(), "one shared level of a decode plan: member rows, blocks, positions")
      .def(py::init<at::Tensor, at::Tensor, int64_t>(), py::kw_only(), py::arg("members"), py::arg("blocks"),
           py::arg("num_positions"))
      .def_readonly("members", &SharedPrefixLevel::members)
      .def_readonly("blocks", &SharedPrefixLevel::blocks)
      .def_readonly("num_positions", &SharedPrefixLevel::num_positions);

  py::class_<SharedPrefixDecodePlan>(m, "SharedPrefixDecodePlan", py::module_local(), "a decode step's shared-prefix plan: suffix starts, levels outer first")
      .def(py::init<at::Tensor, std::vector<SharedPrefixLevel>>(), py::kw_only(), py::arg("suffix_start"), py::arg("levels"))
      .def_readonly("suffix_start", &SharedPrefixDecodePlan::suffix_start)
      .def_readonly("levels", &SharedPrefixDecodePlan::levels);
}
