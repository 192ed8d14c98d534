// The moe_route family's torch-free core (moe_route.h).
//
// A decode step calls it once per sparse layer for one token: the router is E·D fp32 (512 KiB
// for OLMoE's 64 × 2048), read from memory each time, so the logits are split over the threads
// by expert; each logit stays one thread's dot in one order, so the split never moves a bit.
// The softmax and the top k are E values a token, done where the logits are.
#include "moe_route.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace route {
namespace {

using simd::load8;

// Σ x_i·r_i over D: see the header's order
float dot(const float* x, const float* r, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const int64_t D32 = D / 32 * 32;
  for (int64_t i = 0; i < D32; i += 32) {
    a0 = _mm256_fmadd_ps(load8(x + i), load8(r + i), a0);
    a1 = _mm256_fmadd_ps(load8(x + i + 8), load8(r + i + 8), a1);
    a2 = _mm256_fmadd_ps(load8(x + i + 16), load8(r + i + 16), a2);
    a3 = _mm256_fmadd_ps(load8(x + i + 24), load8(r + i + 24), a3);
  }
  if (D > D32) {
    float xb[32] = {}, rb[32] = {};
    std::copy(x + D32, x + D, xb);
    std::copy(r + D32, r + D, rb);
    a0 = _mm256_fmadd_ps(load8(xb), load8(rb), a0);
    a1 = _mm256_fmadd_ps(load8(xb + 8), load8(rb + 8), a1);
    a2 = _mm256_fmadd_ps(load8(xb + 16), load8(rb + 16), a2);
    a3 = _mm256_fmadd_ps(load8(xb + 24), load8(rb + 24), a3);
  }
  return simd::hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

// one token's softmax over its E logits and top k (see the header); p and order: E each, the
// call's scratch
void choose(const float* logits, int64_t E, int64_t k, bool renormalise, float* weights, int64_t* experts,
            std::vector<float>& p, std::vector<int64_t>& order) {
  const float mx = *std::max_element(logits, logits + E);
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(logits[e] - mx);
  for (int64_t e = 0; e < E; ++e) p[e] /= sum;
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  float chosen = 0.f;
  for (int64_t j = 0; j < k; ++j) chosen += p[order[j]];
  for (int64_t j = 0; j < k; ++j) {
    experts[j] = order[j];
    weights[j] = renormalise ? p[order[j]] / chosen : p[order[j]];
  }
}

template <typename X>
void route_impl(const X* x, const float* router, int64_t T, int64_t D, int64_t E, int64_t k, bool renormalise,
                float* weights, int64_t* experts) {
  if (T <= 0) return;
  // bf16 tokens widened once (exactly); fp32 ones read in place
  std::vector<float> widened;
  const float* xf;
  if constexpr (sizeof(X) == 2) {
    widened.resize(static_cast<size_t>(T * D));
    for (int64_t i = 0; i < T * D; ++i) widened[i] = simd::bf16_to_f32(x[i]);
    xf = widened.data();
  } else {
    xf = x;
  }
  std::vector<float> logits(static_cast<size_t>(T * E));
  const int64_t items = T * E;
#pragma omp parallel for schedule(static) if (items > 1 && items * D >= (int64_t{1} << 16))
  for (int64_t item = 0; item < items; ++item) {
    const int64_t t = item / E, e = item % E;
    logits[item] = dot(xf + t * D, router + e * D, D);
  }
  std::vector<float> p(static_cast<size_t>(E));
  std::vector<int64_t> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t)
    choose(logits.data() + t * E, E, k, renormalise, weights + t * k, experts + t * k, p, order);
}

}  // namespace

void route(const float* x, const float* router, int64_t T, int64_t D, int64_t E, int64_t k, bool renormalise,
           float* weights, int64_t* experts) {
  route_impl(x, router, T, D, E, k, renormalise, weights, experts);
}
void route(const uint16_t* x, const float* router, int64_t T, int64_t D, int64_t E, int64_t k, bool renormalise,
           float* weights, int64_t* experts) {
  route_impl(x, router, T, D, E, k, renormalise, weights, experts);
}

}  // namespace route
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
