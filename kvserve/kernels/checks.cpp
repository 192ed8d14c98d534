// Argument checks every level's kernels share (torch only, no intrinsics): compiled into
// every build with the rest of the glue (kvserve/kernels/build.py).
#include "kernels.h"

void check_int8_pools(const at::Tensor& k_pool, const at::Tensor& v_pool, const c10::optional<at::Tensor>& k_scale,
                      const c10::optional<at::Tensor>& v_scale, const char* who) {
  TORCH_CHECK(v_pool.scalar_type() == at::kChar && k_scale && v_scale && k_scale->scalar_type() == at::kFloat &&
                  v_scale->scalar_type() == at::kFloat && k_scale->is_contiguous() && v_scale->is_contiguous(),
              who, ": int8 pools need their contiguous float32 scales");
  TORCH_CHECK(k_scale->numel() * k_pool.size(3) == k_pool.numel() && v_scale->numel() * v_pool.size(3) == v_pool.numel(),
              who, ": one scale per (slot, KV head)");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), who, ": pools must be contiguous");
}
