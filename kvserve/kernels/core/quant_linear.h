// quant_linear, torch-free: y = x·Wᵀ (+ bias) on block-quantized weights
// in the packed layout of kvserve/model/quant_formats.py (QuantSegment in kernels.h, described
// in quant_linear.cpp), with int8 activations per row and block of 32; and the embedding
// lookup of a quantized table.
#pragma once
#include <cstddef>
#include <cstdint>

#include "simd.h"

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace quant {

constexpr int64_t kBlock = 32;  // inputs per quantization block (weights and activations)
constexpr int64_t kGroup = 16;  // output columns per packed group

// the weight formats, numbered as kernels.h's kQuant*
constexpr int kFormatQ8 = 0;     // 8-bit codes q+128, m = -128·d
constexpr int kFormatQ4 = 1;     // 4-bit codes q+8, m = -8·d
constexpr int kFormatQ4Min = 2;  // 4-bit codes, m stored
constexpr int kFormatQ8Min = 3;  // 8-bit codes, m stored

// One QuantSegment as raw pointers.
struct SegmentView {
  const uint8_t* codes;    // [groups, K/32, 512 (8-bit) or 256 (4-bit)]
  const uint16_t* scales;  // fp16 [groups, K/32, 16], or [groups, 1, 16] when per_channel
  const uint16_t* mins;    // fp16 [groups, K/32, 16]; nullptr unless the format stores m
  int64_t groups;          // output columns / 16
  bool per_channel;        // one scale per column for all blocks
  int format;              // kFormat*
};

inline int format_bits(int format) { return format == kFormatQ8 || format == kFormatQ8Min ? 8 : 4; }
inline bool format_has_min(int format) { return format == kFormatQ4Min || format == kFormatQ8Min; }

// Scratch bytes quant_linear needs for M rows of K inputs (the int8 activations, their
// scales and sums).
size_t quant_linear_scratch_bytes(int64_t M, int64_t K);

// y [M, N] = x [M, K] · Wᵀ (+ bias), W the segments stacked by rows (N = Σ 16·groups), K a
// multiple of 32. x is bf16 (x_bf16) or fp32; y is bf16 (y_bf16, rounded to nearest even) or
// fp32, row stride N; bias bf16 [N] or nullptr. `scratch` holds quant_linear_scratch_bytes(M, K)
// bytes, 64-byte aligned. A row's result does not depend on M or on the other rows (bitwise).
void quant_linear(const void* x, bool x_bf16, int64_t M, int64_t K, const SegmentView* segs, int64_t num_segs,
                  const uint16_t* bias, void* y, bool y_bf16, void* scratch);

// out [T, K] fp32: rows ids[t] of W dequantized (d·c + m). ids must be within [0, N).
void quant_embedding(const int64_t* ids, int64_t T, const SegmentView* segs, int64_t num_segs, int64_t K, float* out);

}  // namespace quant
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
