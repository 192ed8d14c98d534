// PLACEHOLDER: the decode_attention family at the portable levels (not yet written). Each function refuses;
// the family is not registered, so KernelSupport keeps its kernels off.
#include "../kernels.h"

namespace {
[[noreturn]] void not_yet(const char* what) {
  TORCH_CHECK(false, what, " is not built at the ", KVSERVE_LEVEL_NAME, " level yet");
}
}  // namespace

at::Tensor paged_decode_attention(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, double, c10::optional<at::Tensor>, c10::optional<at::Tensor>) { not_yet("paged_decode_attention"); }
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_lse(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, double, c10::optional<at::Tensor>, c10::optional<at::Tensor>) { not_yet("paged_decode_attention_lse"); }
void check_int8_pools(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, const char*) { not_yet("check_int8_pools"); }
