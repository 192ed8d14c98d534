// y[M, N] = x[M, K] · w[N, K]ᵀ for small M (batch-1..8 decode), bf16 weights streamed once
// with AVX512-BF16 dot products, fp32 accumulation: gemv_bf16 on the row-major weight,
// gemv_vnni on its VNNI-tile copy (amx_pack_weight's layout) for CPUs without AMX. At these
// sizes PyTorch's generic path reads far below the machine's bandwidth.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "../kernels.h"
#include "vec_math.h"

KVSERVE_KERNEL_FAMILY("gemv");

namespace {

constexpr int kRows = 4;  // weight rows per inner step: each x load feeds 4 dot products

template <int M>
void gemv_block(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t K, int64_t N,
                int64_t n_begin, int64_t n_end) {
  const int64_t k_vec = K / 32 * 32;
  for (int64_t n = n_begin; n < n_end; n += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, n_end - n));
    __m512 acc[M][kRows];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_vec; k += 32) {
      __m512bh wv[kRows];
      for (int r = 0; r < kRows; ++r) {
        const at::BFloat16* row = w + (n + (r < rows ? r : 0)) * K + k;
        _mm_prefetch(reinterpret_cast<const char*>(row + 8 * K), _MM_HINT_T0);
        wv[r] = (__m512bh)_mm512_loadu_si512(row);
      }
      for (int m = 0; m < M; ++m) {
        __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int r = 0; r < rows; ++r) {
        float sum = _mm512_reduce_add_ps(acc[m][r]);
        for (int64_t k = k_vec; k < K; ++k)
          sum += static_cast<float>(x[m * K + k]) * static_cast<float>(w[(n + r) * K + k]);
        y[m * N + n + r] = to_bf16(sum);
      }
    }
  }
}

template <int M>
void gemv_dispatch(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, int64_t K, int64_t N) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    gemv_block<M>(x, w, y, K, N, b0 * kRows, std::min(N, b1 * kRows));
  });
}

// y[M, N] = x[M, K] · wᵀ for small M on the VNNI-tile copy of w (amx_pack_weight's layout:
// per block of 16 output columns, K/32 tiles of 16 rows of pairs, one block contiguous),
// for CPUs without AMX. Each 64-byte tile row holds one pair of input features for all 16
// columns, so a broadcast pair of x times that row is one VDPBF16PS into the 16 columns'
// sums: the weights stream strictly in order and no horizontal sums are left. Row-major,
// gemv_block reads 4 rows 1,152 bytes apart (K = 576); on a Zen 4 it streamed the 30
// layers' projections at ~22 GB/s where this layout read ~39 (one row, from memory).
// Every output is one sum over the tiles, then the pairs, in order: the order of
// gemm_vnni_8x32 too, so a row's bits never depend on how many rows are in the call (the
// engine's batch invariance). VDPBF16PS's latency is hidden by B column blocks in flight
// at once (independent sums) where M rows alone are too few, never by splitting a sum.
template <int M, int B>
void gemv_vnni_blocks(const at::BFloat16* x, const at::BFloat16* wp, at::BFloat16* y, int64_t K, int64_t N,
                      int64_t nb0, int64_t nb1) {
  const int64_t tiles = K / 32;
  int64_t nb = nb0;
  for (; nb + B <= nb1; nb += B) {
    __m512 acc[M][B];
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < B; ++b) acc[m][b] = _mm512_setzero_ps();
    const at::BFloat16* tile = wp + nb * tiles * 512;
    for (int64_t kb = 0; kb < tiles; ++kb, tile += 512) {
#pragma GCC unroll 2
      for (int kp = 0; kp < 16; ++kp) {
        __m512bh wv[B];
#pragma GCC unroll 4
        for (int b = 0; b < B; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(tile + b * tiles * 512 + kp * 32);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          int32_t pair;  // (x[2kp], x[2kp + 1]) of this tile's 32 features, low half first like w's pairs
          std::memcpy(&pair, x + m * K + kb * 32 + 2 * kp, sizeof(pair));
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
          for (int b = 0; b < B; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < B; ++b) store16(y + m * N + (nb + b) * 16, acc[m][b]);
  }
  if constexpr (B > 1) {
    if (nb < nb1) gemv_vnni_blocks<M, 1>(x, wp, y, K, N, nb, nb1);  // the blocks left: same sums, one at a time
  }
}

// Any number of rows on the VNNI tiles: tiles of 8 rows (the remainder with its own count)
// over each group of 16 columns, 64 rows at a time so their x stays in cache while every
// column group passes. With it the tile copy serves every row count on CPUs without AMX, and
// the weight is held once (SmolLM2's gate/up, 512 rows, one thread: 174 GFLOP/s against
// oneDNN's 183 on its own blocked copy).
// 8 rows × 32 columns (two groups of 16) per tile: each broadcast pair of x feeds two
// VDPBF16PS, half the broadcasts per multiply-add of gemv_vnni_blocks<8, 1>. Each output
// sums in the same order as gemv_vnni_blocks (one accumulator, tiles then pairs), so a row's
// bits do not depend on which of the two kernels its tile took.
void gemm_vnni_8x32(const at::BFloat16* x, const at::BFloat16* wp, at::BFloat16* y, int64_t K, int64_t N, int64_t nb) {
  const int64_t tiles = K / 32;
  __m512 acc0[8], acc1[8];
  for (int m = 0; m < 8; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  const at::BFloat16* t0 = wp + nb * tiles * 512;
  const at::BFloat16* t1 = t0 + tiles * 512;
  for (int64_t kb = 0; kb < tiles; ++kb, t0 += 512, t1 += 512) {
#pragma GCC unroll 2
    for (int kp = 0; kp < 16; ++kp) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(t0 + kp * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(t1 + kp * 32);
#pragma GCC unroll 8
      for (int m = 0; m < 8; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * K + kb * 32 + 2 * kp, sizeof(pair));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        acc0[m] = _mm512_dpbf16_ps(acc0[m], xv, w0);
        acc1[m] = _mm512_dpbf16_ps(acc1[m], xv, w1);
      }
    }
  }
  for (int m = 0; m < 8; ++m) {
    store16(y + m * N + nb * 16, acc0[m]);
    store16(y + m * N + nb * 16 + 16, acc1[m]);
  }
}

void gemm_vnni_rows(const at::BFloat16* x, const at::BFloat16* wp, at::BFloat16* y, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t kChunk = 64;
  const int64_t groups = N / 16, pairs = (groups + 1) / 2;
  for (int64_t r0 = 0; r0 < M; r0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - r0);
    at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t nb = 2 * p0; nb < std::min(groups, 2 * p1); ++nb) {
        for (int64_t m0 = 0; m0 < rows; m0 += 8) {
          const at::BFloat16* xm = x + (r0 + m0) * K;
          at::BFloat16* ym = y + (r0 + m0) * N;
          if (rows - m0 >= 8 && nb % 2 == 0 && nb + 1 < groups) {
            gemm_vnni_8x32(xm, wp, ym, K, N, nb);
            continue;
          }
          if (nb % 2 == 1 && rows - m0 >= 8) continue;  // its pair's 8x32 tile wrote it
          switch (std::min<int64_t>(8, rows - m0)) {
            case 1: gemv_vnni_blocks<1, 1>(xm, wp, ym, K, N, nb, nb + 1); break;
            case 2: gemv_vnni_blocks<2, 1>(xm, wp, ym, K, N, nb, nb + 1); break;
            case 3: gemv_vnni_blocks<3, 1>(xm, wp, ym, K, N, nb, nb + 1); break;
            case 4: gemv_vnni_blocks<4, 1>(xm, wp, ym, K, N, nb, nb + 1); break;
            case 5: gemv_vnni_blocks<5, 1>(xm, wp, ym, K, N, nb, nb + 1); break;
            case 6: gemv_vnni_blocks<6, 1>(xm, wp, ym, K, N, nb, nb + 1); break;
            case 7: gemv_vnni_blocks<7, 1>(xm, wp, ym, K, N, nb, nb + 1); break;
            default: gemv_vnni_blocks<8, 1>(xm, wp, ym, K, N, nb, nb + 1); break;
          }
        }
      }
    });
  }
}

template <int M>
void gemv_vnni_dispatch(const at::BFloat16* x, const at::BFloat16* wp, at::BFloat16* y, int64_t K, int64_t N) {
  constexpr int B = M <= 2 ? 4 : 1;  // at least 4 sums in flight (8 at M = 2)
  at::parallel_for(0, N / 16, 4, [&](int64_t b0, int64_t b1) { gemv_vnni_blocks<M, B>(x, wp, y, K, N, b0, b1); });
}

// f(std::integral_constant<int, M>{}) for 1 <= M <= 8: the GEMVs' row count as a template
// argument, so their accumulators stay in registers.
static_assert(kGemvMaxRows == 8, "with_rows instantiates 1..8 rows: a new gemv_max_rows needs its cases");
template <typename F>
void with_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// y [M, N] bf16 for x [M, K] bf16 (contiguous), 1 <= M <= kGemvMaxRows: kernel(rows, x, y)
// with the row count as a std::integral_constant (with_rows).
template <typename Kernel>
at::Tensor small_m(const char* name, const at::Tensor& x, int64_t N, Kernel&& kernel) {
  const int64_t M = x.size(0);
  TORCH_CHECK(M >= 1 && M <= kGemvMaxRows, name, ": 1 <= M <= ", kGemvMaxRows, ", got ", M);
  auto y = at::empty({M, N}, x.options());
  auto* xp = x.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  with_rows(M, [&](auto rows) { kernel(rows, xp, yp); });
  return y;
}

}  // namespace

at::Tensor gemv_bf16(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16: bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_bf16: shapes");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t K = x.size(1), N = w.size(0);
  auto* wp = w.data_ptr<at::BFloat16>();
  return small_m("gemv_bf16", x, N, [&](auto rows, const at::BFloat16* xp, at::BFloat16* yp) {
    gemv_dispatch<decltype(rows)::value>(xp, wp, yp, K, N);
  });
}

// x: [M <= kGemvMaxRows, K] bf16; packed: amx_pack_weight(w) for w [N, K]. Returns [M, N] bf16.
at::Tensor gemv_vnni(at::Tensor x, at::Tensor packed) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "gemv_vnni: bf16 only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 32 && packed.is_contiguous(),
              "gemv_vnni: packed must come from amx_pack_weight");
  x = x.contiguous();
  const int64_t K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(x.dim() == 2 && packed.size(1) * 32 == K, "gemv_vnni: x has ", K, " features, the weight ", packed.size(1) * 32);
  auto* wp = packed.data_ptr<at::BFloat16>();
  return small_m("gemv_vnni", x, N, [&](auto rows, const at::BFloat16* xp, at::BFloat16* yp) {
    gemv_vnni_dispatch<decltype(rows)::value>(xp, wp, yp, K, N);
  });
}

// x: [M, K] bf16, any M; packed: amx_pack_weight(w). Returns [M, N] bf16.
at::Tensor gemm_vnni(at::Tensor x, at::Tensor packed) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "gemm_vnni: bf16 only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 32 && packed.is_contiguous(),
              "gemm_vnni: packed must come from amx_pack_weight");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(x.dim() == 2 && packed.size(1) * 32 == K, "gemm_vnni: x has ", K, " features, the weight ", packed.size(1) * 32);
  auto y = at::empty({M, N}, x.options());
  if (M > 0) gemm_vnni_rows(x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), M, K, N);
  return y;
}
