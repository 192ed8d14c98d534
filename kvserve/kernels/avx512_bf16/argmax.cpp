// Greedy sampling: the row-wise argmax of logits, ties to the lowest index as torch.argmax.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>

#include "../kernels.h"
#include "vec_math.h"

KVSERVE_KERNEL_FAMILY("argmax");

namespace {

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  // per-lane running max and the first index reaching it; ties keep the lowest index
  const int64_t nv = n / 16 * 16;
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_idx = _mm512_setzero_si512();
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t i = 0; i < nv; i += 16) {
    __m512 v = load16(x + i);
    __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  alignas(64) float vals[16];
  alignas(64) int32_t ids[16];
  _mm512_store_ps(vals, best);
  _mm512_store_si512(ids, best_idx);
  float top = -INFINITY;
  int64_t arg = 0;
  for (int lane = 0; lane < 16; ++lane)
    if (vals[lane] > top || (vals[lane] == top && ids[lane] < arg)) { top = vals[lane]; arg = ids[lane]; }
  for (int64_t i = nv; i < n; ++i) {
    float v = static_cast<float>(x[i]);
    if (v > top) { top = v; arg = i; }
  }
  return arg;
}

}  // namespace

// Row-wise argmax of logits [R, V] (ties → lowest index, as torch.argmax).
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "argmax_rows: [R, V] contiguous");
  const int64_t R = x.size(0), V = x.size(1);
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  auto* o = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16) {
    const auto* p = x.data_ptr<at::BFloat16>();
    at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) { for (int64_t r = b; r < e; ++r) o[r] = argmax_row(p + r * V, V); });
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "argmax_rows: bf16 or fp32");
    const auto* p = x.data_ptr<float>();
    at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) { for (int64_t r = b; r < e; ++r) o[r] = argmax_row(p + r * V, V); });
  }
  return out;
}
