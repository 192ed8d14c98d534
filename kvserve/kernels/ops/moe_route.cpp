// The moe_route family's torch layer (moe_route): the argument checks, then the torch-free core
// (core/moe_route.h) on fp32 or bf16 tokens and an fp32 router.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "../core/moe_route.h"
#include "../kernels.h"

KVSERVE_KERNEL_FAMILY("moe_route");

namespace route_core = kvserve::KVSERVE_LEVEL_NS::route;

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& router, int64_t top_k,
                                             bool norm_topk_prob) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "moe_route: x must be [T, d] contiguous, got ", x.sizes());
  TORCH_CHECK(router.dim() == 2 && router.is_contiguous() && router.scalar_type() == at::kFloat &&
                  router.size(1) == x.size(1),
              "moe_route: the router must be fp32 [experts, d] contiguous with d = ", x.size(1), ", got ",
              router.sizes(), " ", router.scalar_type());
  const int64_t T = x.size(0), D = x.size(1), E = router.size(0);
  TORCH_CHECK(0 < top_k && top_k <= E, "moe_route: top_k ", top_k, " of ", E, " experts");
  auto weights = at::empty({T, top_k}, x.options().dtype(at::kFloat));
  auto experts = at::empty({T, top_k}, x.options().dtype(at::kLong));
  const float* r = router.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    route_core::route(x.data_ptr<float>(), r, T, D, E, top_k, norm_topk_prob, weights.data_ptr<float>(),
                      experts.data_ptr<int64_t>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "moe_route: x must be float32 or bfloat16, got ", x.scalar_type());
    route_core::route(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), r, T, D, E, top_k, norm_topk_prob,
                      weights.data_ptr<float>(), experts.data_ptr<int64_t>());
  }
  return {weights, experts};
}
