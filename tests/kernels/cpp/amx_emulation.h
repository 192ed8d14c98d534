// AMX-BF16 tile instructions in plain C++, for testing kvserve/kernels/core/amx/ on CPUs without
// AMX (tests/kernels/test_amx_emulated.py): force-included before the core source with
// -DKVSERVE_AMX_EMULATED. Each thread has its own 8 tiles and configuration, as on hardware.
// TDPBF16PS is written as the Intel SDM describes it: for each row m of A and column n of C,
// over the pairs k in order, C[m][n] += A[m][2k]·B[k][2n] + A[m][2k+1]·B[k][2n+1] in fp32,
// bf16 inputs widened exactly, denormal inputs read as zero. (Hardware's rounding of the pair
// sum may differ in the last bit; the tests compare with torch at bf16 tolerances and check
// bitwise only what the kernel must make equal by construction.)
#pragma once
#include <immintrin.h>  // first: its own tile declarations, which the macros below then replace

#include <cstdint>
#include <cstring>

namespace kvserve_amx_emulation {

struct State {
  uint8_t tile[8][16][64];
  uint8_t rows[8];
  uint16_t colsb[8];
};
inline thread_local State state;

inline float widen(uint16_t b) {
  if ((b & 0x7f80) == 0) b &= 0x8000;  // denormal (or zero) in: zero
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void loadconfig(const void* cfg) {
  const uint8_t* c = static_cast<const uint8_t*>(cfg);
  for (int t = 0; t < 8; ++t) {
    std::memcpy(&state.colsb[t], c + 16 + 2 * t, 2);
    state.rows[t] = c[48 + t];
  }
}

inline void loadd(int t, const void* base, long stride) {
  for (int r = 0; r < state.rows[t]; ++r)
    std::memcpy(state.tile[t][r], static_cast<const uint8_t*>(base) + r * stride, state.colsb[t]);
}

inline void stored(int t, void* base, long stride) {
  for (int r = 0; r < state.rows[t]; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, state.tile[t][r], state.colsb[t]);
}

inline void zero(int t) { std::memset(state.tile[t], 0, sizeof(state.tile[t])); }

inline void dpbf16ps(int c, int a, int b) {
  const int M = state.rows[c], N = state.colsb[c] / 4, K = state.colsb[a] / 4;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float acc;
      std::memcpy(&acc, state.tile[c][m] + 4 * n, 4);
      for (int k = 0; k < K; ++k) {
        uint16_t a0, a1, b0, b1;
        std::memcpy(&a0, state.tile[a][m] + 4 * k, 2);
        std::memcpy(&a1, state.tile[a][m] + 4 * k + 2, 2);
        std::memcpy(&b0, state.tile[b][k] + 4 * n, 2);
        std::memcpy(&b1, state.tile[b][k] + 4 * n + 2, 2);
        acc += widen(a0) * widen(b0) + widen(a1) * widen(b1);
      }
      std::memcpy(state.tile[c][m] + 4 * n, &acc, 4);
    }
}

}  // namespace kvserve_amx_emulation

#undef _tile_loadconfig
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_release
#define _tile_loadconfig(cfg) kvserve_amx_emulation::loadconfig(cfg)
#define _tile_loadd(t, base, stride) kvserve_amx_emulation::loadd(t, base, stride)
#define _tile_stored(t, base, stride) kvserve_amx_emulation::stored(t, base, stride)
#define _tile_zero(t) kvserve_amx_emulation::zero(t)
#define _tile_dpbf16ps(c, a, b) kvserve_amx_emulation::dpbf16ps(c, a, b)
#define _tile_release() ((void)0)
