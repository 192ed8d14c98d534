// The gemv family, torch-free: y[M, N] = x[M, K] · w[N, K]ᵀ in bf16
// with fp32 accumulation, on the row-major weight (gemv_bf16) or on its VNNI-tile copy
// (amx_pack_weight's layout, gemv_vnni / gemm_vnni). The layouts and summation orders are
// described in gemv_core.cpp (named apart from ops/gemv.cpp: torch's build names objects by file name).
#pragma once
#include <cstdint>

#include "simd.h"

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace gemv {

constexpr int64_t kTileN = 16;  // output columns per VNNI column block (kernels.h kWeightTileRows)
constexpr int64_t kTileK = 32;  // input features per VNNI tile (kernels.h kWeightTileK)

// y[M, N] bf16 = x[M, K] · w[N, K]ᵀ, x, w, y bf16 contiguous, w row-major; any M, K, N. Each
// output is summed in one order whatever M (a row's bits never depend on the other rows).
void gemv_rowmajor(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t K, int64_t N);

// y[M, N] bf16 = x[M, K] · w[N, K]ᵀ on wp = the VNNI tiles of w ([N/16, K/32, 16, 32] bf16:
// tile (nb, kb) row kp holds, for each column n of the block, the pair
// (w[16nb + n][32kb + 2kp], w[16nb + n][32kb + 2kp + 1])). N % 16 == 0, K % 32 == 0, any M.
// Every output sums its K products in k order into one fp32 accumulator, whatever M and
// whichever tile shape serves its row: a row's bits never depend on the rest of the call.
// pair_dots (the levels with simd::kBf16Dot only): the products by VDPBF16PS pair dots, else
// widened to fp32 and FMA'd as the levels below do; the two give different bits, so a
// process keeps one choice for every call (ops/gemv.cpp set_bf16_pair_dots).
void gemm_tiles(const uint16_t* x, const uint16_t* wp, uint16_t* y, int64_t M, int64_t K, int64_t N,
                bool pair_dots = simd::kBf16Dot);

}  // namespace gemv
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
