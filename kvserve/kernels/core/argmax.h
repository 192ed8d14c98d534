// Greedy sampling's row-wise argmax, torch-free (the core of kernels.h's argmax_rows): out[r] = the index of the largest of x[r, 0..V), ties to the lowest index
// (as torch.argmax). Exact: comparisons only, so the result never depends on how a row is
// split into vectors, chunks or threads. NaN is never chosen.
// A row of all -inf (or V = 0) gives 0.
#pragma once
#include <cstdint>

#include "simd.h"

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace argmax {

// x [R, V] contiguous, fp32 or bf16 (uint16_t); out int64 [R]
void argmax_rows(const float* x, int64_t* out, int64_t R, int64_t V);
void argmax_rows(const uint16_t* x, int64_t* out, int64_t R, int64_t V);

}  // namespace argmax
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
