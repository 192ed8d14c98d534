// The amx_linear family's torch layer (the `amx` level's build only; elsewhere ops/absent.cpp
// stands in): the checks, x padded to whole A tiles, and the call into core/amx/amx_linear_core.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "../../core/amx/amx_linear.h"
#include "../../kernels.h"

KVSERVE_KERNEL_FAMILY("amx_linear");

namespace amx_core = kvserve::KVSERVE_LEVEL_NS::amx;

static_assert(amx_core::kTileN == kWeightTileRows && amx_core::kTileK == kWeightTileK, "the AMX tiles are kernels.h's");
static_assert(amx_core::kArgmaxMaxRows == kAmxArgmaxMaxRows, "the argmax epilogue's rows are kernels.h's");

namespace amx_layer {

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

at::Tensor run(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
               amx_core::Epilogue epilogue) {
  const bool silu_mul = epilogue == amx_core::Epilogue::kSiluMul, argmax = epilogue == amx_core::Epilogue::kArgmax;
  TORCH_CHECK(amx_core::granted(), "amx_linear: AMX-BF16 is not available on this CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "amx_linear: bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == amx_core::kTileRows && packed.size(3) == amx_core::kTileK &&
                  packed.is_contiguous(),
              "amx_linear: packed layout");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KB = packed.size(1), N = NB * amx_core::kTileN;
  TORCH_CHECK(K == KB * amx_core::kTileK, "amx_linear: x has ", K, " features, the weight ", KB * amx_core::kTileK);
  TORCH_CHECK(!bias || (bias->numel() == N && bias->scalar_type() == at::kBFloat16), "amx_linear: bias");
  TORCH_CHECK(!silu_mul || (NB % 2 == 0 && !bias), "amx_linear_silu_mul: gate/up block pairs, no bias");
  TORCH_CHECK(!argmax || M <= kAmxArgmaxMaxRows, "amx_linear_argmax: at most ", kAmxArgmaxMaxRows, " rows");
  const int64_t N_out = silu_mul ? N / 2 : N;
  at::Tensor y = argmax ? at::empty({M}, x.options().dtype(at::kLong)) : at::empty({M, N_out}, x.options());
  if (M == 0) return y;
  // A tiles read 16 whole rows: x padded to a multiple of 16 rows (zeros) when it is not one
  const int64_t Mp = (M + amx_core::kTileRows - 1) / amx_core::kTileRows * amx_core::kTileRows;
  at::Tensor xs = x.contiguous();
  if (Mp != M) {
    xs = at::zeros({Mp, K}, x.options());
    xs.narrow(0, 0, M).copy_(x);
  }
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  amx_core::linear(bits(xs), M, K, bits(packed), NB, bias ? bits(b) : nullptr, epilogue,
                   argmax ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
                   argmax ? y.data_ptr<int64_t>() : nullptr);
  return y;
}

}  // namespace amx_layer

bool amx_available() { return amx_core::granted(); }

// x [M, K] bf16, packed from amx_pack_weight, bias [N] or empty → y [M, N] bf16.
at::Tensor amx_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  return amx_layer::run(x, packed, bias, amx_core::Epilogue::kStore);
}

// x [M, K], the gate/up projection packed with its blocks interleaved → silu(gate) · up [M, N/2]
at::Tensor amx_linear_silu_mul(at::Tensor x, at::Tensor packed) {
  return amx_layer::run(x, packed, c10::nullopt, amx_core::Epilogue::kSiluMul);
}

// x [M, K] (M <= kAmxArgmaxMaxRows) → argmax over each row of x·Wᵀ (+ bias) rounded to bf16,
// int64 [M]: bitwise argmax_rows(amx_linear(x, ...)).
at::Tensor amx_linear_argmax(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  return amx_layer::run(x, packed, bias, amx_core::Epilogue::kArgmax);
}
