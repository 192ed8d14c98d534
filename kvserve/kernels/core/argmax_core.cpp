// The argmax family's torch-free core (argmax.h).
//
// A row is read in chunks of kChunk elements (a multiple of 32); each chunk keeps, in 4
// vectors of 8 lanes, every lane's running maximum and the first index reaching it (a strict
// greater-than: a later equal value never replaces an earlier one), reduced to the chunk's
// (max, lowest index of it); the row's chunks then merge in order, a later chunk winning only
// when strictly greater. Elements past the last whole vector are compared one by one after the
// vectors, in order. Long rows of few-row calls (decode's logits) spread their chunks over the
// threads; the result is the same index whichever way a row is split (only comparisons).
#include "argmax.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace argmax {
namespace {

using simd::load8;

constexpr int64_t kChunk = 8192;

struct Best {
  float value;
  int64_t index;
};

inline float scalar(const float* p) { return *p; }
inline float scalar(const uint16_t* p) { return simd::bf16_to_f32(*p); }

// (max, its lowest index) of x[b, e), indices relative to x; b a multiple of 32. Ties to the
// lowest index; NaN never wins; all -inf gives (-inf, b).
template <typename T>
Best chunk_best(const T* x, int64_t b, int64_t e) {
  __m256 best[4];
  __m256i idx_best[4];
  __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(b)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int k = 0; k < 4; ++k) {
    best[k] = _mm256_set1_ps(-INFINITY);
    idx_best[k] = _mm256_set1_epi32(static_cast<int>(b));
  }
  const __m256i step = _mm256_set1_epi32(8);
  int64_t i = b;
  for (; i + 32 <= e; i += 32) {
    for (int k = 0; k < 4; ++k) {
      const __m256 v = load8(x + i + 8 * k);
      const __m256 gt = _mm256_cmp_ps(v, best[k], _CMP_GT_OQ);
      best[k] = _mm256_blendv_ps(best[k], v, gt);
      idx_best[k] = _mm256_blendv_epi8(idx_best[k], idx, _mm256_castps_si256(gt));
      idx = _mm256_add_epi32(idx, step);
    }
  }
  for (int k = 0; i + 8 <= e; i += 8, ++k) {  // at most 3 more whole vectors
    const __m256 v = load8(x + i);
    const __m256 gt = _mm256_cmp_ps(v, best[k], _CMP_GT_OQ);
    best[k] = _mm256_blendv_ps(best[k], v, gt);
    idx_best[k] = _mm256_blendv_epi8(idx_best[k], idx, _mm256_castps_si256(gt));
    idx = _mm256_add_epi32(idx, step);
  }
  alignas(32) float vals[32];
  alignas(32) int32_t ids[32];
  for (int k = 0; k < 4; ++k) {
    _mm256_store_ps(vals + 8 * k, best[k]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ids + 8 * k), idx_best[k]);
  }
  Best r{-INFINITY, b};
  for (int lane = 0; lane < 32; ++lane)
    if (vals[lane] > r.value || (vals[lane] == r.value && ids[lane] < r.index)) r = {vals[lane], ids[lane]};
  for (; i < e; ++i) {
    const float v = scalar(x + i);
    if (v > r.value) r = {v, i};
  }
  return r;
}

template <typename T>
void argmax_impl(const T* x, int64_t* out, int64_t R, int64_t V) {
  if (R <= 0) return;
  const int64_t chunks = std::max<int64_t>(1, (V + kChunk - 1) / kChunk);
  const int64_t tasks = R * chunks;
  const bool par = tasks > 1 && R * V >= (int64_t{1} << 15);
  if (chunks == 1) {
#pragma omp parallel for schedule(static) if (par)
    for (int64_t r = 0; r < R; ++r) out[r] = chunk_best(x + r * V, 0, V).index;
    return;
  }
  std::vector<Best> part(tasks);
#pragma omp parallel for schedule(static) if (par)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t r = task / chunks, b = task % chunks * kChunk;
    part[task] = chunk_best(x + r * V, b, std::min(V, b + kChunk));
  }
  for (int64_t r = 0; r < R; ++r) {
    Best best = part[r * chunks];
    for (int64_t c = 1; c < chunks; ++c)
      if (part[r * chunks + c].value > best.value) best = part[r * chunks + c];
    out[r] = best.index;
  }
}

}  // namespace

void argmax_rows(const float* x, int64_t* out, int64_t R, int64_t V) { argmax_impl(x, out, R, V); }
void argmax_rows(const uint16_t* x, int64_t* out, int64_t R, int64_t V) { argmax_impl(x, out, R, V); }

}  // namespace argmax
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
