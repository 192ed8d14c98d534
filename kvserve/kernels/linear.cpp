// One projection y = x·Wᵀ (+ b) by the rows it gets, on whichever copies of the weight its
// Projection holds (kernels.h): the GEMV up to gemv_max_rows (decode of a few requests;
// it streams the weights once near memory bandwidth), the AMX kernel up to amx_max_rows
// (batched decode, mixed steps), oneDNN on its own blocked layout past that (prefill
// chunks, and every row count past the GEMV's on CPUs without AMX), else at::linear.
// Python's linear methods decide the fields once per weight and call linear() too, as
// decode_layers does, so the two paths cannot dispatch differently.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include "kernels.h"

namespace {

// oneDNN's linear on a weight it packed (torch.ops.mkldnn._linear_pointwise(x, packed, bias,
// "none", [], "") as Python spells it). Boxed, so no C++ signature of ours has to match the
// operator's registration.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias.defined() && bias.numel() > 0 ? c10::IValue(bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

c10::optional<at::Tensor> optional_bias(const Projection& p) {
  return p.bias.defined() ? c10::optional<at::Tensor>(p.bias) : c10::nullopt;
}

// N, from whichever copy of the weight the projection has
int64_t out_features(const Projection& p) {
  if (!p.quant.empty()) return quant_out_features(p.quant);
  if (p.weight.defined()) return p.weight.size(0);
  if (p.onednn.defined()) return p.onednn.size(0);
  if (p.gemv.defined()) return p.gemv.size(0) * kWeightTileRows;
  TORCH_CHECK(p.amx.defined(), "linear: the Projection has none of weight, gemv, amx and onednn");
  return p.amx.size(0) * kWeightTileRows;
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const Projection& p) {
  TORCH_CHECK(x.dim() == 2, "linear: x must be [rows, K], got ", x.dim(), " dimensions");
  const int64_t rows = x.size(0);
  if (!p.quant.empty()) return quant_linear(x, p.quant, optional_bias(p), p.float_out);
  if (rows == 0) return at::empty({0, out_features(p)}, x.options());
  if (rows <= p.gemv_max_rows) {
    TORCH_CHECK(p.gemv_max_rows <= kGemvMaxRows, "linear: Projection.gemv_max_rows is ", p.gemv_max_rows,
                ", past the GEMV's ", kGemvMaxRows, " rows");
    TORCH_CHECK(p.gemv.defined() || p.weight.defined(), "linear: ", rows, " rows go to the GEMV (Projection.gemv_max_rows = ",
                p.gemv_max_rows, ") but neither Projection.gemv nor Projection.weight is set");
    at::Tensor y = p.gemv.defined() ? gemv_vnni(x, p.gemv) : gemv_bf16(x, p.weight);
    return p.bias.defined() ? y.add_(p.bias) : y;
  }
  if (rows <= p.amx_max_rows && !p.silu_interleaved) {
    TORCH_CHECK(p.amx.defined(), "linear: ", rows, " rows go to the AMX kernel (Projection.amx_max_rows = ",
                p.amx_max_rows, ") but Projection.amx is not set");
    return amx_linear(x, p.amx, optional_bias(p));
  }
  if (p.gemv_all_rows) {
    TORCH_CHECK(p.gemv.defined(), "linear: Projection.gemv_all_rows is set but Projection.gemv is not");
    at::Tensor y = gemm_vnni(x, p.gemv);
    return p.bias.defined() ? y.add_(p.bias) : y;
  }
  if (p.onednn.defined()) return onednn_linear(x.contiguous(), p.onednn, p.bias);
  TORCH_CHECK(p.weight.defined(), "linear: ", rows, " rows are past the GEMV's and AMX's (Projection.gemv_max_rows = ",
              p.gemv_max_rows, ", amx_max_rows = ", p.amx_max_rows,
              ") with neither Projection.onednn nor Projection.weight set");
  return at::linear(x, p.weight, optional_bias(p));
}

at::Tensor linear_silu_mul(const at::Tensor& x, const Projection& p) {
  const int64_t rows = x.size(0);
  if (p.silu_interleaved && rows > p.gemv_max_rows && rows <= p.amx_max_rows) {
    TORCH_CHECK(p.amx.defined(), "linear_silu_mul: ", rows, " rows go to amx_linear_silu_mul (Projection.amx_max_rows = ",
                p.amx_max_rows, ", silu_interleaved) but Projection.amx is not set");
    return amx_linear_silu_mul(x, p.amx);
  }
  return silu_and_mul(linear(x, p));
}
