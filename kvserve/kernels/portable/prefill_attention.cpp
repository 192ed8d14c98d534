// PLACEHOLDER: the prefill_attention family at the portable levels (not yet written). Each function refuses;
// the family is not registered, so KernelSupport keeps its kernels off.
#include "../kernels.h"

namespace {
[[noreturn]] void not_yet(const char* what) {
  TORCH_CHECK(false, what, " is not built at the ", KVSERVE_LEVEL_NAME, " level yet");
}
}  // namespace

void paged_prefill_attention(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, double, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>) { not_yet("paged_prefill_attention"); }
