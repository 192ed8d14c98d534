// PLACEHOLDER: the shared_prefix_attention family at the portable levels (not yet written). Each function refuses;
// the family is not registered, so KernelSupport keeps its kernels off.
#include "../kernels.h"

namespace {
[[noreturn]] void not_yet(const char* what) {
  TORCH_CHECK(false, what, " is not built at the ", KVSERVE_LEVEL_NAME, " level yet");
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> shared_prefix_attention(at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, double, c10::optional<at::Tensor>, c10::optional<at::Tensor>) { not_yet("shared_prefix_attention"); }
std::tuple<at::Tensor, at::Tensor> merge_attention_states(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::ScalarType) { not_yet("merge_attention_states"); }
void merge_attention_row(const float*, float, const float*, float, int64_t, float*, at::BFloat16*, float*) { not_yet("merge_attention_row"); }
