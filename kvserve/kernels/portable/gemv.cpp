// PLACEHOLDER: the gemv family at the portable levels (not yet written). Each function refuses;
// the family is not registered, so KernelSupport keeps its kernels off.
#include "../kernels.h"

namespace {
[[noreturn]] void not_yet(const char* what) {
  TORCH_CHECK(false, what, " is not built at the ", KVSERVE_LEVEL_NAME, " level yet");
}
}  // namespace

at::Tensor gemv_bf16(at::Tensor, at::Tensor) { not_yet("gemv_bf16"); }
at::Tensor gemv_vnni(at::Tensor, at::Tensor) { not_yet("gemv_vnni"); }
at::Tensor gemm_vnni(at::Tensor, at::Tensor) { not_yet("gemm_vnni"); }
at::Tensor amx_pack_weight(at::Tensor) { not_yet("amx_pack_weight"); }
