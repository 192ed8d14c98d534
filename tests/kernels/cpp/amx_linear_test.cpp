// Test driver for kvserve/kernels/core/amx/amx_linear_core.cpp on emulated tiles
// (amx_emulation.h), built and run by tests/kernels/test_amx_emulated.py. Each check compares
// the kernel with a scalar reference that sums in the emulated instruction's own order, so an
// index, a loop bound, a depth chunk, a padding row or an epilogue that is off shows as a
// bitwise difference. Prints one line per failure and "ok <checks>" at the end; exit 1 on failure.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../../../kvserve/kernels/core/amx/amx_linear.h"
#include "../../../kvserve/kernels/core/simd.h"

namespace amx = kvserve::KVSERVE_LEVEL_NS::amx;
namespace simd = kvserve::KVSERVE_LEVEL_NS::simd;

static int failures = 0, checks = 0;

static void expect(bool ok, const char* what, long a, long b, long c) {
  ++checks;
  if (!ok && failures++ < 20) std::printf("FAIL %s (%ld, %ld, %ld)\n", what, a, b, c);
}

static float widen(uint16_t b) {
  if ((b & 0x7f80) == 0) b &= 0x8000;
  return simd::bf16_to_f32(b);
}

// w [N, K] → VNNI tiles [N/16][K/32][16][32]
static std::vector<uint16_t> pack(const std::vector<uint16_t>& w, int64_t N, int64_t K) {
  std::vector<uint16_t> p(N * K);
  for (int64_t nb = 0; nb < N / 16; ++nb)
    for (int64_t kb = 0; kb < K / 32; ++kb)
      for (int64_t kp = 0; kp < 16; ++kp)
        for (int64_t n = 0; n < 16; ++n)
          for (int64_t e = 0; e < 2; ++e)
            p[(((nb * (K / 32) + kb) * 16 + kp) * 16 + n) * 2 + e] = w[(16 * nb + n) * K + 32 * kb + 2 * kp + e];
  return p;
}

// y[m][n] as the tiles sum it: per depth block, per pair, a0·b0 + a1·b1 added in fp32
static float dot(const uint16_t* x, const uint16_t* w, int64_t K) {
  float acc = 0.f;
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    float c = acc;
    for (int64_t k = 0; k < 16; ++k) {
      const int64_t i = 32 * kb + 2 * k;
      c += widen(x[i]) * widen(w[i]) + widen(x[i + 1]) * widen(w[i + 1]);
    }
    acc = c;
  }
  return acc;
}

static uint16_t bf16(float f) { return simd::f32_to_bf16(f); }

static void run_case(int64_t M, int64_t N, int64_t K, bool with_bias, int threads, std::mt19937& rng) {
  omp_set_num_threads(threads);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t Mp = (M + 15) / 16 * 16;
  std::vector<uint16_t> x(Mp * K, 0), w(N * K), bias(N);
  for (int64_t i = 0; i < M * K; ++i) x[i] = bf16(nd(rng));
  for (auto& v : w) v = bf16(nd(rng) * 0.1f);
  for (auto& v : bias) v = bf16(nd(rng));
  const std::vector<uint16_t> packed = pack(w, N, K);
  const uint16_t* bp = with_bias ? bias.data() : nullptr;

  // kStore: bitwise the ordered reference (+ bias in fp32, one rounding)
  std::vector<uint16_t> y(M * N);
  amx::linear(x.data(), M, K, packed.data(), N / 16, bp, amx::Epilogue::kStore, y.data(), nullptr);
  int64_t bad = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float v = dot(x.data() + m * K, w.data() + n * K, K);
      if (bp) v += widen(bp[n]);
      bad += y[m * N + n] != bf16(v);
    }
  expect(bad == 0, "store", M, N, K);

  // a row's bits do not depend on the rows beside it: row m alone gives the same
  for (int64_t m : {int64_t{0}, M / 2, M - 1}) {
    std::vector<uint16_t> x1(16 * K, 0), y1(N);
    std::memcpy(x1.data(), x.data() + m * K, K * 2);
    amx::linear(x1.data(), 1, K, packed.data(), N / 16, bp, amx::Epilogue::kStore, y1.data(), nullptr);
    expect(std::memcmp(y1.data(), y.data() + m * N, N * 2) == 0, "row alone", M, m, K);
  }

  // kArgmax (decode sizes): the lowest column of the row's largest bf16 output
  if (M <= amx::kArgmaxMaxRows) {
    std::vector<int64_t> am(M);
    amx::linear(x.data(), M, K, packed.data(), N / 16, bp, amx::Epilogue::kArgmax, nullptr, am.data());
    for (int64_t m = 0; m < M; ++m) {
      int64_t best = 0;
      for (int64_t n = 1; n < N; ++n)
        if (widen(y[m * N + n]) > widen(y[m * N + best])) best = n;
      expect(am[m] == best, "argmax", M, m, am[m]);
    }
  }

  // kSiluMul on [gate; up] interleaved by blocks of 16: silu_and_mul of the plain product
  if (N % 32 == 0 && !with_bias) {
    const int64_t F = N / 2;
    std::vector<uint16_t> inter(N * K);
    for (int64_t p = 0; p < F / 16; ++p)
      for (int64_t r = 0; r < 16; ++r) {
        std::memcpy(&inter[((2 * p) * 16 + r) * K], &w[(p * 16 + r) * K], K * 2);          // gate block p
        std::memcpy(&inter[((2 * p + 1) * 16 + r) * K], &w[(F + p * 16 + r) * K], K * 2);  // up block p
      }
    const std::vector<uint16_t> ipacked = pack(inter, N, K);
    std::vector<uint16_t> s(M * F);
    amx::linear(x.data(), M, K, ipacked.data(), N / 16, nullptr, amx::Epilogue::kSiluMul, s.data(), nullptr);
    int64_t sbad = 0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t f = 0; f < F; f += 8) {
        const __m256 g = simd::load8(y.data() + m * N + f), u = simd::load8(y.data() + m * N + F + f);
        alignas(32) uint16_t ref[8];
        simd::store8(ref, _mm256_mul_ps(simd::round_bf16(simd::silu8(g)), u));
        sbad += std::memcmp(ref, s.data() + m * F + f, 16) != 0;
      }
    expect(sbad == 0, "silu_mul", M, N, K);
  }
}

int main() {
  std::mt19937 rng(0);
  // rows: one A tile, a partial one, the decode-shaped loop's bound (128) and past it (panels,
  // odd tiles); columns: odd column blocks, gate/up pairs; depth: several depth chunks (K/32
  // times 4 row tiles past 24 A tiles)
  const int64_t shapes[][3] = {{1, 32, 32},   {5, 48, 64},    {16, 64, 96},  {17, 96, 576}, {64, 160, 576},
                               {100, 64, 1024}, {128, 96, 256}, {129, 80, 128}, {300, 64, 192}, {513, 48, 64}};
  for (const auto& s : shapes)
    for (int threads : {1, 2, 3})
      for (bool bias : {false, true}) run_case(s[0], s[1], s[2], bias, threads, rng);
  if (failures) {
    std::printf("%d of %d checks failed\n", failures, checks);
    return 1;
  }
  std::printf("ok %d\n", checks);
  return 0;
}
