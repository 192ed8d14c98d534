// PLACEHOLDER: the quant_linear family at the portable levels (not yet written). Each function refuses;
// the family is not registered, so KernelSupport keeps its kernels off.
#include "../kernels.h"

namespace {
[[noreturn]] void not_yet(const char* what) {
  TORCH_CHECK(false, what, " is not built at the ", KVSERVE_LEVEL_NAME, " level yet");
}
}  // namespace

at::Tensor quant_linear(const at::Tensor&, const std::vector<QuantSegment>&, const c10::optional<at::Tensor>&, bool) { not_yet("quant_linear"); }
at::Tensor quant_embedding(const at::Tensor&, const std::vector<QuantSegment>&, int64_t, at::ScalarType) { not_yet("quant_embedding"); }
int64_t quant_out_features(const std::vector<QuantSegment>&) { not_yet("quant_out_features"); }
