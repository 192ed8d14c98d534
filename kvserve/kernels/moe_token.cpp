// One token's routed experts in one C++ call (kvserve/model/moe.py SparseMoE, batch-1 decode):
// the router's top k in fp32 (moe_route), the k experts' [gate; up] as one quant_linear over their stacked
// segments, silu·up, the k down projections as one quant_linear_rows, and the weighted sum in
// expert order. The same kernels (and ATen ops), in the same order, as moe.py's Python path for
// one token (so the same bits, which tests/model/test_moe.py holds); what it saves is the
// Python between them, where the second thread waited a third of a decode step.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "kernels.h"

std::tuple<at::Tensor, at::Tensor> moe_token(const at::Tensor& x, const at::Tensor& router, const MoeExperts& experts,
                                             int64_t top_k, bool norm_topk_prob) {
  const int64_t E = static_cast<int64_t>(experts.gate_up.size());
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "moe_token: x must be [1, d]");
  TORCH_CHECK(router.dim() == 2 && router.size(0) == E && router.scalar_type() == at::kFloat,
              "moe_token: the router must be fp32 [experts, d] with one row per expert");
  TORCH_CHECK(static_cast<int64_t>(experts.down.size()) == E && 0 < top_k && top_k <= E, "moe_token: top_k ", top_k,
              " of ", E, " experts");
  // moe.py route(): softmax over all experts in fp32, the top k, renormalised where asked
  auto [weights, chosen] = moe_route(x.contiguous(), router, top_k, norm_topk_prob);
  const float* w = weights.data_ptr<float>();
  const int64_t* ids = chosen.data_ptr<int64_t>();
  // the experts in index order, as moe.py sorts them (and as the batched path meets them)
  std::vector<int64_t> order(static_cast<size_t>(top_k));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  std::vector<QuantSegment> gate_up;
  std::vector<std::vector<QuantSegment>> down;
  at::Tensor sorted = at::empty({top_k}, chosen.options());
  for (int64_t j = 0; j < top_k; ++j) {
    const int64_t e = ids[order[j]];
    sorted.data_ptr<int64_t>()[j] = e;
    gate_up.insert(gate_up.end(), experts.gate_up[e].begin(), experts.gate_up[e].end());
    down.push_back(experts.down[e]);
  }
  const at::Tensor hidden = silu_and_mul(quant_linear(x, gate_up, c10::nullopt, false).view({top_k, -1}));
  const at::Tensor y = quant_linear_rows(hidden, down, experts.float_out);
  // out += y_j · w_j in expert order: what moe.py's `out += y.float() * w` computes (ATen's mul by
  // a float scalar, then the add, each rounded in fp32), without 4·k small ATen ops on the
  // step's serial path. `volatile` keeps the product a rounded float: the compiler may not
  // contract the two into an FMA, whose single rounding would change the bits.
  const int64_t d = x.size(1);
  at::Tensor out = at::empty({1, d}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  std::fill(o, o + d, 0.f);
  const at::Tensor yc = y.contiguous();
  const bool bf16 = yc.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || yc.scalar_type() == at::kFloat, "moe_token: the downs' output must be bf16 or fp32");
  for (int64_t j = 0; j < top_k; ++j) {
    const float wj = w[order[j]];
    if (bf16) {
      const uint16_t* yj = reinterpret_cast<const uint16_t*>(yc.data_ptr<at::BFloat16>()) + j * d;
      for (int64_t i = 0; i < d; ++i) {
        uint32_t bits = static_cast<uint32_t>(yj[i]) << 16;  // bf16 -> fp32: exact
        float v;
        std::memcpy(&v, &bits, sizeof(v));
        volatile float p = v * wj;
        o[i] = o[i] + p;
      }
    } else {
      const float* yj = yc.data_ptr<float>() + j * d;
      for (int64_t i = 0; i < d; ++i) {
        volatile float p = yj[i] * wj;
        o[i] = o[i] + p;
      }
    }
  }
  return {out, sorted};
}
