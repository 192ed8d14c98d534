// y = x·Wᵀ (+ b) on block-quantized weights, every row count, on AVX512-VNNI: the compute
// format is an int8 dot product. Each row of x is quantized per block of 32 features
// (symmetric int8, one fp32 scale, as llama.cpp's Q8_0 activations), then per block of 32
// weights of one output column
//     Σ_k w_k·x_k = d_x · (d_w · Σ_k c_k·q_k + m_w · Σ_k q_k),    w_k = d_w·c_k + m_w,
// where c_k is the weight's unsigned code (VPDPBUSD multiplies unsigned by signed bytes)
// and m_w its block minimum: stored for the formats that have one (Q4_1, Q4_K, Q5_1, Q5_K),
// else -offset·d_w (Q8_0's codes are q+128, Q4_0's q with offset 8).
//
// The layout (QuantSegment in kernels.h; packed by kvserve/kernels/layouts.py): per
// group of 16 output columns and per block of 32 features,
//   8-bit codes: 8 vectors of [16 columns][4 features]: byte j·64 + 4c + t = c_{col c}[4j + t]
//   4-bit codes: 4 vectors; byte j·64 + 4c + t = c[4j + t] | c[16 + 4j + t] << 4
// so one 64-byte load feeds a VPDPBUSD for all 16 columns with a broadcast 4 bytes of x,
// and the weights stream strictly in order; scales (and minima) fp16 [groups, blocks, 16]
// (one block for a per-output-channel scale).
//
// A row's result does not depend on the other rows of the call: each row's blocks are
// summed in the same order with the same operations whatever the tile it lands in (the
// integer sums are exact, so splitting them for latency changes nothing). GEMV (decode)
// and GEMM (prefill) are the same code.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../kernels.h"
#include "vec_math.h"

KVSERVE_KERNEL_FAMILY("quant_linear");

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQuantTileRows = 8;    // rows of x per register tile
constexpr int64_t kChunkRows = 64;  // rows whose quantized x stays cache-resident while every column group passes

// ---- activations --------------------------------------------------------------------------

struct QuantizedRows {
  at::Tensor q;                  // int8 [M, K]
  at::Tensor scale, sum;         // fp32 [M, K/32]: d_x, and Σ q of the block
};

template <typename T>
void quantize_block(const T* x, int8_t* q, float* d, float* s) {
  const __m512 v0 = load16(x), v1 = load16(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  // _mm512_cvtps_epi32 rounds to nearest even (the default MXCSR); |v·inv| <= 127
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
  *d = amax / 127.f;
  *s = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
}

QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), KB = K / kBlock;
  QuantizedRows r{at::empty({M, K}, x.options().dtype(at::kChar)), at::empty({M, KB}, x.options().dtype(at::kFloat)),
                  at::empty({M, KB}, x.options().dtype(at::kFloat))};
  int8_t* q = r.q.data_ptr<int8_t>();
  float* d = r.scale.data_ptr<float>();
  float* s = r.sum.data_ptr<float>();
  // each block on its own: the split between threads cannot change a value
  auto run = [&](auto* xp) {
    at::parallel_for(0, M * KB, 512, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) quantize_block(xp + (i / KB) * K + (i % KB) * kBlock, q + (i / KB) * K + (i % KB) * kBlock, d + i, s + i);
    });
  };
  if (x.scalar_type() == at::kBFloat16) run(x.data_ptr<at::BFloat16>());
  else run(x.data_ptr<float>());
  return r;
}

// ---- weights ------------------------------------------------------------------------------

struct Segment {        // one QuantSegment as raw pointers
  const uint8_t* codes;
  const uint16_t* scales;
  const uint16_t* mins;  // nullptr unless the format stores minima
  int64_t groups;        // output columns / 16
  bool per_channel;      // one scale per column for all blocks
  int format;
  int64_t col0;          // first output column in y
};

inline __m512 load_half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

inline void store_row(at::BFloat16* y, __m512 v) { store16(y, v); }
inline void store_row(float* y, __m512 v) { _mm512_storeu_ps(y, v); }

// R rows of x (quantized) against one group of 16 columns: y[r][col0 + 16g ...]
template <int Bits, bool HasMin, int R, typename Out>
void column_group(const Segment& w, int64_t g, const int8_t* xq, const float* xd, const float* xs, int64_t K,
                  float offset, const at::BFloat16* bias, Out* y, int64_t ldy) {
  constexpr int64_t kBytes = Bits * 16 * kBlock / 8;  // codes per (group, block): 512 or 256
  constexpr int A = R >= 4 ? 1 : 2;                    // integer sums per row: more hide latency when rows are few
  const int64_t KB = K / kBlock;
  const uint8_t* codes = w.codes + g * KB * kBytes;
  const uint16_t* scales = w.scales + g * (w.per_channel ? 1 : KB) * 16;
  const uint16_t* mins = HasMin ? w.mins + g * KB * 16 : nullptr;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b, codes += kBytes) {
    __m512i sum[A][R];
    for (int a = 0; a < A; ++a)
      for (int r = 0; r < R; ++r) sum[a][r] = _mm512_setzero_si512();
    const int8_t* xb = xq + b * kBlock;
    if constexpr (Bits == 8) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i wv = _mm512_loadu_si512(codes + j * 64);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) sum[j % A][r] = _mm512_dpbusd_epi32(sum[j % A][r], wv, bcast4(xb + r * K + 4 * j));
      }
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i wv = _mm512_loadu_si512(codes + j * 64);
        const __m512i lo = _mm512_and_si512(wv, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low4);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          sum[0][r] = _mm512_dpbusd_epi32(sum[0][r], lo, bcast4(xb + r * K + 4 * j));
          sum[A - 1][r] = _mm512_dpbusd_epi32(sum[A - 1][r], hi, bcast4(xb + r * K + 16 + 4 * j));
        }
      }
    }
    const __m512 d = load_half16(scales + (w.per_channel ? 0 : b * 16));
    const __m512 m = HasMin ? load_half16(mins + b * 16) : _mm512_mul_ps(d, _mm512_set1_ps(-offset));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512i s = sum[0][r];
      if constexpr (A > 1) s = _mm512_add_epi32(s, sum[1][r]);
      const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, _mm512_mul_ps(_mm512_set1_ps(xs[r * KB + b]), m));
      acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(xd[r * KB + b]), acc[r]);
    }
  }
  const int64_t col = w.col0 + g * 16;
  const __m512 bv = bias ? load16(bias + col) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) store_row(y + r * ldy + col, bias ? _mm512_add_ps(acc[r], bv) : acc[r]);
}

template <int Bits, bool HasMin, typename Out>
void rows_tile(int64_t rows, const Segment& w, int64_t g, const int8_t* xq, const float* xd, const float* xs, int64_t K,
               float offset, const at::BFloat16* bias, Out* y, int64_t ldy) {
  const int64_t KB = K / kBlock;
#define KVSERVE_QL_CASE(R) \
  case R: column_group<Bits, HasMin, R>(w, g, xq, xd, xs, K, offset, bias, y, ldy); break;
  for (int64_t r0 = 0; r0 < rows; r0 += kQuantTileRows) {
    switch (std::min<int64_t>(kQuantTileRows, rows - r0)) {
      KVSERVE_QL_CASE(1) KVSERVE_QL_CASE(2) KVSERVE_QL_CASE(3) KVSERVE_QL_CASE(4)
      KVSERVE_QL_CASE(5) KVSERVE_QL_CASE(6) KVSERVE_QL_CASE(7) default: KVSERVE_QL_CASE(8)
    }
    xq += kQuantTileRows * K;
    xd += kQuantTileRows * KB;
    xs += kQuantTileRows * KB;
    y += kQuantTileRows * ldy;
  }
#undef KVSERVE_QL_CASE
}

template <typename Out>
void run_group(int64_t rows, const Segment& w, int64_t g, const int8_t* xq, const float* xd, const float* xs, int64_t K,
               const at::BFloat16* bias, Out* y, int64_t ldy) {
  switch (w.format) {
    case kQuantQ8: rows_tile<8, false>(rows, w, g, xq, xd, xs, K, 128.f, bias, y, ldy); break;
    case kQuantQ8Min: rows_tile<8, true>(rows, w, g, xq, xd, xs, K, 0.f, bias, y, ldy); break;
    case kQuantQ4: rows_tile<4, false>(rows, w, g, xq, xd, xs, K, 8.f, bias, y, ldy); break;
    default: rows_tile<4, true>(rows, w, g, xq, xd, xs, K, 0.f, bias, y, ldy); break;
  }
}

int64_t segment_bits(int64_t format) { return format == kQuantQ8 || format == kQuantQ8Min ? 8 : 4; }

bool has_min(int64_t format) { return format == kQuantQ8Min || format == kQuantQ4Min; }

std::vector<Segment> check_segments(const std::vector<QuantSegment>& segs, int64_t K, const char* who) {
  TORCH_CHECK(!segs.empty(), who, ": no weight segments");
  std::vector<Segment> out;
  int64_t col = 0;
  for (const QuantSegment& s : segs) {
    TORCH_CHECK(s.format >= kQuantQ8 && s.format <= kQuantQ8Min, who, ": unknown QuantSegment.format ", s.format);
    const int64_t groups = s.codes.size(0), KB = K / kBlock;
    TORCH_CHECK(s.codes.dim() == 3 && s.codes.scalar_type() == at::kByte && s.codes.is_contiguous() &&
                    s.codes.size(1) == KB && s.codes.size(2) == segment_bits(s.format) * 16 * kBlock / 8,
                who, ": codes must be uint8 [groups, K/32, ", segment_bits(s.format) * 64, "] for K = ", K);
    TORCH_CHECK(s.scales.dim() == 3 && s.scales.scalar_type() == at::kHalf && s.scales.is_contiguous() &&
                    s.scales.size(0) == groups && (s.scales.size(1) == KB || s.scales.size(1) == 1) && s.scales.size(2) == 16,
                who, ": scales must be fp16 [groups, K/32 or 1, 16]");
    const bool mins = has_min(s.format);
    if (mins)
      TORCH_CHECK(s.mins.defined() && s.mins.scalar_type() == at::kHalf && s.mins.is_contiguous() &&
                      s.mins.numel() == groups * KB * 16,
                  who, ": this format needs mins, fp16 [groups, K/32, 16]");
    out.push_back(Segment{s.codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(s.scales.data_ptr<at::Half>()),
                          mins ? reinterpret_cast<const uint16_t*>(s.mins.data_ptr<at::Half>()) : nullptr, groups,
                          s.scales.size(1) == 1 && KB != 1, static_cast<int>(s.format), col});
    col += groups * 16;
  }
  return out;
}

}  // namespace

int64_t quant_out_features(const std::vector<QuantSegment>& segs) {
  int64_t n = 0;
  for (const QuantSegment& s : segs) n += s.codes.size(0) * 16;
  return n;
}

at::Tensor quant_linear(const at::Tensor& x_in, const std::vector<QuantSegment>& segs, const c10::optional<at::Tensor>& bias,
                        bool float_out) {
  TORCH_CHECK(x_in.dim() == 2, "quant_linear: x must be [rows, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat, "quant_linear: x must be bf16 or fp32");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "quant_linear: K = ", K, " is not a multiple of ", kBlock);
  const std::vector<Segment> w = check_segments(segs, K, "quant_linear");
  const int64_t N = quant_out_features(segs);
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (M == 0) return y;
  const at::BFloat16* bp = nullptr;
  at::Tensor b;
  if (bias && bias->defined()) {
    b = bias->to(at::kBFloat16).contiguous();
    TORCH_CHECK(b.numel() == N, "quant_linear: bias has ", b.numel(), " values for ", N, " outputs");
    bp = b.data_ptr<at::BFloat16>();
  }
  const QuantizedRows xr = quantize_rows(x);
  const int8_t* xq = xr.q.data_ptr<int8_t>();
  const float* xd = xr.scale.data_ptr<float>();
  const float* xs = xr.sum.data_ptr<float>();
  std::vector<int64_t> first_group{0};  // the flat index of each segment's first group
  for (const Segment& s : w) first_group.push_back(first_group.back() + s.groups);
  const int64_t groups = first_group.back(), KB = K / kBlock;
  auto run = [&](auto* yp) {
    for (int64_t r0 = 0; r0 < M; r0 += kChunkRows) {
      const int64_t rows = std::min(kChunkRows, M - r0);
      at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
        size_t si = std::upper_bound(first_group.begin(), first_group.end(), g0) - first_group.begin() - 1;
        for (int64_t g = g0; g < g1; ++g) {
          while (g >= first_group[si + 1]) ++si;
          run_group(rows, w[si], g - first_group[si], xq + r0 * K, xd + r0 * KB, xs + r0 * KB, K, bp, yp + r0 * N, N);
        }
      });
    }
  };
  if (y.scalar_type() == at::kBFloat16) run(y.data_ptr<at::BFloat16>());
  else run(y.data_ptr<float>());
  return y;
}

at::Tensor quant_embedding(const at::Tensor& ids_in, const std::vector<QuantSegment>& segs, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(K % kBlock == 0, "quant_embedding: K = ", K, " is not a multiple of ", kBlock);
  const std::vector<Segment> w = check_segments(segs, K, "quant_embedding");
  const int64_t N = quant_out_features(segs), KB = K / kBlock;
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t T = ids.numel();
  at::Tensor out = at::empty({T, K}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "quant_embedding: id ", ip[t], " outside [0, ", N, ")");
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t n = ip[t];
      size_t si = 0;
      while (n >= w[si].groups * 16) n -= w[si++].groups * 16;
      const Segment& s = w[si];
      const int64_t g = n / 16, c = n % 16;
      const int bits = static_cast<int>(segment_bits(s.format));
      const int64_t bytes = bits * 16 * kBlock / 8;
      const float offset = s.format == kQuantQ8 ? 128.f : s.format == kQuantQ4 ? 8.f : 0.f;
      for (int64_t b = 0; b < KB; ++b) {
        const uint8_t* codes = s.codes + (g * KB + b) * bytes;
        const float d = static_cast<float>(c10::Half(s.scales[(g * (s.per_channel ? 1 : KB) + (s.per_channel ? 0 : b)) * 16 + c], c10::Half::from_bits()));
        const float m = s.mins ? static_cast<float>(c10::Half(s.mins[(g * KB + b) * 16 + c], c10::Half::from_bits())) : -offset * d;
        float* row = op + t * K + b * kBlock;
        for (int k = 0; k < kBlock; ++k) {
          int code;
          if (bits == 8) code = codes[(k / 4) * 64 + c * 4 + k % 4];
          else {
            const int kk = k % 16;
            const uint8_t byte = codes[(kk / 4) * 64 + c * 4 + kk % 4];
            code = k < 16 ? (byte & 0x0f) : (byte >> 4);
          }
          row[k] = d * static_cast<float>(code) + m;
        }
      }
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}
