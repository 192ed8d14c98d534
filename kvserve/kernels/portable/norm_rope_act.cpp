// PLACEHOLDER: the norm_rope_act family at the portable levels (not yet written). Each function refuses;
// the family is not registered, so KernelSupport keeps its kernels off.
#include "../kernels.h"

namespace {
[[noreturn]] void not_yet(const char* what) {
  TORCH_CHECK(false, what, " is not built at the ", KVSERVE_LEVEL_NAME, " level yet");
}
}  // namespace

at::Tensor rms_norm(at::Tensor, at::Tensor, double, c10::optional<at::Tensor>) { not_yet("rms_norm"); }
at::Tensor rope_and_cache(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t) { not_yet("rope_and_cache"); }
at::Tensor rope_and_cache_int8(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t) { not_yet("rope_and_cache_int8"); }
at::Tensor silu_and_mul(at::Tensor) { not_yet("silu_and_mul"); }
