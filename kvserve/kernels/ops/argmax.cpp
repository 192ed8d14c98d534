// argmax_rows: the argument checks, then the torch-free core (core/argmax.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "../core/argmax.h"
#include "../kernels.h"

KVSERVE_KERNEL_FAMILY("argmax");

namespace argmax_core = kvserve::KVSERVE_LEVEL_NS::argmax;

// Row-wise argmax of logits [R, V] bf16 or fp32 (ties → lowest index, as torch.argmax).
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "argmax_rows: [R, V] contiguous");
  const int64_t R = x.size(0), V = x.size(1);
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  auto* o = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16) {
    argmax_core::argmax_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), o, R, V);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "argmax_rows: bf16 or fp32");
    argmax_core::argmax_rows(x.data_ptr<float>(), o, R, V);
  }
  return out;
}
