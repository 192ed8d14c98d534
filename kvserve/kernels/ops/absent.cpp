// What every build but the `amx` level's does not have: AMX (ops/amx/ in the amx build). The functions exist so that one bindings.cpp serves every level; each says
// it is not here rather than reaching an instruction this CPU may lack. kvserve never calls
// them at these levels (KernelSupport turns the AMX kernels off where amx_available() is false).
#include "../kernels.h"

namespace {
[[noreturn]] void absent(const char* what) {
  TORCH_CHECK(false, what, " needs AMX; this kernel build is for the ", KVSERVE_LEVEL_NAME, " level");
}
}  // namespace

bool amx_available() { return false; }

at::Tensor amx_linear(at::Tensor, at::Tensor, c10::optional<at::Tensor>) { absent("amx_linear"); }
at::Tensor amx_linear_silu_mul(at::Tensor, at::Tensor) { absent("amx_linear_silu_mul"); }
at::Tensor amx_linear_argmax(at::Tensor, at::Tensor, c10::optional<at::Tensor>) { absent("amx_linear_argmax"); }
