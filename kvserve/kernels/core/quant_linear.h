// quant_linear, torch-free: y = x·Wᵀ (+ bias) on block-quantized weights
// in the packed layout of kvserve/model/quant_formats.py (QuantSegment in kernels.h, described
// in quant_linear.cpp), with int8 activations per row and block of 32 (per super-block of 256
// against the K-quants, as llama.cpp's Q8_K); and the embedding lookup of a quantized table.
#pragma once
#include <cstddef>
#include <cstdint>

#include "simd.h"

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace quant {

constexpr int64_t kBlock = 32;  // inputs per quantization block (weights and activations)
constexpr int64_t kGroup = 16;  // output columns per packed group

constexpr int64_t kSuper = 256;  // inputs per super-block of the K-quant formats (their d, dmin)

// the weight formats, numbered as kernels.h's kQuant*
constexpr int kFormatQ8 = 0;     // 8-bit codes q+128, m = -128·d
constexpr int kFormatQ4 = 1;     // 4-bit codes q+8, m = -8·d
constexpr int kFormatQ4Min = 2;  // 4-bit codes, m stored
constexpr int kFormatQ8Min = 3;  // 8-bit codes, m stored
constexpr int kFormatQ4K = 4;    // 4-bit codes, w = d·sc·c − dmin·mn: GGUF Q4_K as stored
constexpr int kFormatQ6K = 5;    // 6-bit codes q+32, w = d·sc·q, sc per 16 inputs: GGUF Q6_K as stored

// One QuantSegment as raw pointers. The K-quant formats (kFormatQ4K, kFormatQ6K) keep a
// super-block's fp16 d (and dmin) per column per 256 inputs in `scales` (`mins`), and each
// block's small integer scales in `sub`.
struct SegmentView {
  const uint8_t* codes;    // [groups, K/32, 512 (8-bit), 384 (6-bit) or 256 (4-bit)]
  const uint16_t* scales;  // fp16 [groups, K/32, 16], [groups, 1, 16] when per_channel, [groups, K/256, 16] (K-quants)
  const uint16_t* mins;    // fp16 as scales; nullptr unless the format stores m (dmin for kFormatQ4K)
  const uint8_t* sub;      // K-quants: [groups, K/32, 32]: Q4K 16 sc then 16 mn (uint8), Q6K 16 sc of inputs
                           // 0-15 then 16 of 16-31 (int8); nullptr otherwise
  int64_t groups;          // output columns / 16
  bool per_channel;        // one scale per column for all blocks
  int format;              // kFormat*
};

inline int format_bits(int format) {
  return format == kFormatQ8 || format == kFormatQ8Min ? 8 : format == kFormatQ6K ? 6 : 4;
}
inline bool format_has_min(int format) { return format == kFormatQ4Min || format == kFormatQ8Min || format == kFormatQ4K; }
inline bool format_is_k_quant(int format) { return format == kFormatQ4K || format == kFormatQ6K; }

// Scratch bytes quant_linear needs for M rows of K inputs (the int8 activations, their
// scales, their sums and the sums of each block's first 16, per block and per super-block).
size_t quant_linear_scratch_bytes(int64_t M, int64_t K);

// y [M, N] = x [M, K] · Wᵀ (+ bias), W the segments stacked by rows (N = Σ 16·groups), K a
// multiple of 32. x is bf16 (x_bf16) or fp32; y is bf16 (y_bf16, rounded to nearest even) or
// fp32, row stride N; bias bf16 [N] or nullptr. `scratch` holds quant_linear_scratch_bytes(M, K)
// bytes, 64-byte aligned. A row's result does not depend on M or on the other rows (bitwise).
void quant_linear(const void* x, bool x_bf16, int64_t M, int64_t K, const SegmentView* segs, int64_t num_segs,
                  const uint16_t* bias, void* y, bool y_bf16, void* scratch);

// y [R, N]: row r = x[r] · W_rᵀ, W_r the segments segs[first[r] .. first[r + 1]) stacked by
// rows (N outputs for every r), no bias: a token's k routed experts (their inputs differ) in one
// parallel pass, so the threads stream all k weights without a fork and join per expert.
// Row r's bits are quant_linear's of x[r] alone against W_r. Scratch as quant_linear(R, K).
void quant_linear_rows(const void* x, bool x_bf16, int64_t R, int64_t K, const SegmentView* segs, const int64_t* first,
                       void* y, bool y_bf16, void* scratch);

// out [T, K] fp32: rows ids[t] of W dequantized (d·c + m). ids must be within [0, N).
void quant_embedding(const int64_t* ids, int64_t T, const SegmentView* segs, int64_t num_segs, int64_t K, float* out);

}  // namespace quant
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
