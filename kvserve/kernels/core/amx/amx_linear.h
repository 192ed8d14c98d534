// The amx_linear family, torch-free: y = x·Wᵀ (+ bias) in bf16 on Intel AMX tiles, for batched
// decode and mixed steps (kernels/linear.cpp sends it the rows past the GEMV's, up to a
// Projection's amx_max_rows). Compiled only into the `amx` level's build (kvserve/kernels/build.py):
// every other level's build holds no AMX instruction (tests/kernels/test_isa.py).
//
// The weight is the VNNI-tile layout every level reads (kvserve/kernels/layouts.py
// pack_bf16_tiles, amx_pack_weight): per column block nb (16 output columns) and depth block kb
// (32 inputs) one 1 KiB tile whose row kp holds, for each column n, the pair
// (w[16nb + n][32kb + 2kp], w[16nb + n][32kb + 2kp + 1]): the B operand of TDPBF16PS.
#pragma once
#include <cstdint>

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace amx {

constexpr int64_t kTileRows = 16;  // rows of x per A tile; pairs per B tile
constexpr int64_t kTileK = 32;     // bf16 inputs per tile
constexpr int64_t kTileN = 16;     // output columns per column block
constexpr int64_t kArgmaxMaxRows = 128;  // kernels.h kAmxArgmaxMaxRows: the decode-shaped loop's rows

// The CPU has AMX-BF16 and Linux handed this process the tile state (asked once).
bool granted();

// What leaves the accumulators: y itself; silu(gate)·up (W holds gate and up with their
// 16-column blocks interleaved, y is [M, N/2], no bias); or only each row's argmax.
enum class Epilogue { kStore, kSiluMul, kArgmax };

// x: bf16 [Mp, K], Mp = M rounded up to 16, rows past M zero (A tiles read whole 16 rows);
// packed: [NB, K/32, 16, 32] bf16; bias: bf16 [16·NB] or null (never with kSiluMul).
// kStore: y bf16 [M, 16·NB]; kSiluMul: y bf16 [M, 8·NB], bitwise silu_and_mul of the
// kStore result; kArgmax (M <= kArgmaxMaxRows): argmax int64 [M], bitwise argmax_rows of
// the kStore result (the lowest column on ties). Each output is rounded to bf16 once.
void linear(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, int64_t NB, const uint16_t* bias,
            Epilogue epilogue, uint16_t* y, int64_t* argmax);

}  // namespace amx
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
