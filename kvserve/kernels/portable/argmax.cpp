// PLACEHOLDER: the argmax family at the portable levels (not yet written). Each function refuses;
// the family is not registered, so KernelSupport keeps its kernels off.
#include "../kernels.h"

namespace {
[[noreturn]] void not_yet(const char* what) {
  TORCH_CHECK(false, what, " is not built at the ", KVSERVE_LEVEL_NAME, " level yet");
}
}  // namespace

at::Tensor argmax_rows(at::Tensor) { not_yet("argmax_rows"); }
