// amx_linear's core (amx_linear.h) on AMX-BF16 tiles, compiled at the `amx` level only.
//
// Why our own: at decode-step row counts, oneDNN's packed GEMM runs at ~1.2 TFLOP/s when its
// weights sit in cache but only at ~9 GB/s of weights when they come from memory, as they do
// in a decode step (every layer's weights are touched once per step). This kernel streams each
// weight tile exactly once per 64 rows of x, in the order it is stored, and prefetches the tiles
// it will need a few column blocks ahead (in the 64-request decode step it read ~16 GB/s of
// weights, against ~9 for oneDNN, on a Sapphire Rapids host whose probe saw 16-34 GB/s). For the
// MLP, the kSiluMul epilogue applies silu(gate)·up as the tiles leave the accumulators.
//
// Each output is one C tile element: TDPBF16PS over the depth blocks in order, whatever the
// row count or which loop serves it (the decode-sized loop's depth chunks park the partial
// tiles in memory and reload them, which changes no bit).
#include "amx_linear.h"

#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../simd.h"

// (KVSERVE_AMX_EMULATED: tests/kernels/cpp/amx_emulation.h stands in for the tiles)
#if (!defined(__AMX_TILE__) || !defined(__AMX_BF16__)) && !defined(KVSERVE_AMX_EMULATED)
#error "core/amx/ is compiled at the amx level only (kvserve/kernels/build.py)"
#endif

namespace kvserve {
namespace KVSERVE_LEVEL_NS {
namespace amx {
namespace {

constexpr int kGroupTiles = 4;       // A tiles (64 rows of x) per pass over a weight tile
constexpr int64_t kSmallTiles = 8;   // up to 128 rows of x: the decode-shaped loop
static_assert(kSmallTiles * kTileRows == kArgmaxMaxRows, "the argmax epilogue runs in the decode-shaped loop only");
constexpr int64_t kPanelTiles = 16;  // 256 rows of x per panel in the larger-x loop
// Column blocks (with depth chunks: chunk runs) whose weights are prefetched into L2 while
// one computes. Measured in the 64-request decode step: no prefetch ~10% slower (12-27% with
// depth chunks); 1 to 16 ahead, with the T0, T1 or T2 hint, within noise.
constexpr int kPrefetchBlocks = 2;
// The decode-sized loop cuts depth into chunks whose A tiles (1 KiB each) number at most
// kChunkATiles, so they stay in L1 (48 KiB) beside the weight tiles streaming through; a
// group of units (at most kGroupUnits) goes through one chunk after another, its partial
// C tiles (4 KiB per block) parked in L1/L2 between chunks. On the 30 layers' 64-row
// decode linears, from memory: 24 beat 16 and 36 A tiles; groups of 4 and 16 units were
// within noise, 64 slower.
constexpr int64_t kChunkATiles = 24;
constexpr int64_t kGroupUnits = 16;
constexpr int64_t kTileFloats = kTileRows * kTileN;

// Tiles 0-3: the four C accumulators (16 rows × 16 fp32); 4, 5: A (16 rows × 32 bf16) or,
// in column_block, A and B; 6, 7: B in column_pair.
constexpr int kTilesUsed = 8;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0..count-1 as 16 rows × 64 bytes for the calling thread (tile state is per thread: each
// parallel region configures on entry and releases on exit)
inline void configure_full_tiles(int count) {
  TileConfig cfg;
  for (int t = 0; t < count; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// 16 fp32 as bf16, nearest even, as simd::store8 rounds
inline void store16(uint16_t* y, const float* v) {
  simd::store8(y, simd::load8(v));
  simd::store8(y + 8, simd::load8(v + 8));
}

// one row of a C tile (+ bias, in fp32) out to y as bf16
inline void store_row(const float* acc, const uint16_t* bias, uint16_t* y) {
  for (int h = 0; h < 2; ++h) {
    __m256 v = simd::load8(acc + 8 * h);
    if (bias) v = _mm256_add_ps(v, simd::load8(bias + 8 * h));
    simd::store8(y + 8 * h, v);
  }
}

// One column block against `Tiles` (1..4) A tiles, over depth blocks [0, KB) of the pointers
// given. The C tiles start from zero, or with `accumulate` from acc (an earlier depth chunk's
// partial sums), and end in acc.
template <int Tiles>
void column_block(const uint16_t* x, int64_t x_stride_bytes, const uint16_t* wblock, const char* prefetch, int64_t KB,
                  float (*acc)[kTileFloats], bool accumulate) {
  if (accumulate) {
    _tile_loadd(0, acc[0], 64);
    if constexpr (Tiles > 1) _tile_loadd(1, acc[1], 64);
    if constexpr (Tiles > 2) _tile_loadd(2, acc[2], 64);
    if constexpr (Tiles > 3) _tile_loadd(3, acc[3], 64);
  } else {
    _tile_zero(0);
    if constexpr (Tiles > 1) _tile_zero(1);
    if constexpr (Tiles > 2) _tile_zero(2);
    if constexpr (Tiles > 3) _tile_zero(3);
  }
  const int64_t tile_step = kTileRows * x_stride_bytes / 2;
  for (int64_t kb = 0; kb < KB; ++kb) {
    if (prefetch)
      for (int line = 0; line < 16; ++line) _mm_prefetch(prefetch + kb * 1024 + line * 64, _MM_HINT_T1);
    _tile_loadd(5, wblock + kb * kTileRows * kTileK, 64);
    const uint16_t* a = x + kb * kTileK;
    _tile_loadd(4, a, x_stride_bytes);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (Tiles > 1) {
      _tile_loadd(4, a + tile_step, x_stride_bytes);
      _tile_dpbf16ps(1, 4, 5);
    }
    if constexpr (Tiles > 2) {
      _tile_loadd(4, a + 2 * tile_step, x_stride_bytes);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (Tiles > 3) {
      _tile_loadd(4, a + 3 * tile_step, x_stride_bytes);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, acc[0], 64);
  if constexpr (Tiles > 1) _tile_stored(1, acc[1], 64);
  if constexpr (Tiles > 2) _tile_stored(2, acc[2], 64);
  if constexpr (Tiles > 3) _tile_stored(3, acc[3], 64);
}

// 32 rows of x against two column blocks, all of K: a 2×2 grid of C tiles, so each tile
// loaded feeds two products (column_block's 4×1 grid reloads A for every product, which is
// fine while the weights are the bottleneck but not when x is large and they are hot).
void column_pair(const uint16_t* x, int64_t x_stride_bytes, const uint16_t* w0, const uint16_t* w1, int64_t KB,
                 float (*acc)[kTileFloats]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t tile_step = kTileRows * x_stride_bytes / 2;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint16_t* a = x + kb * kTileK;
    _tile_loadd(4, a, x_stride_bytes);
    _tile_loadd(6, w0 + kb * kTileRows * kTileK, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w1 + kb * kTileRows * kTileK, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + tile_step, x_stride_bytes);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc[0], 64);
  _tile_stored(1, acc[1], 64);
  _tile_stored(2, acc[2], 64);
  _tile_stored(3, acc[3], 64);
}

// (value a, index ia) beats (b, ib): larger, or as large with a lower index; NaN never wins
// (as in argmax_rows, whose running max compares with >, false for NaN).
inline bool better(float a, int64_t ia, float b, int64_t ib) { return a > b || (a == b && ia < ib); }

// One thread's running argmax per row of x over the column blocks it computes: per row the
// best bf16-rounded value so far and its column (a strictly greater value replaces it, so a tie
// keeps the earlier, lower column; each thread's blocks arrive in increasing order).
struct RowArgmax {
  std::vector<float> value;
  std::vector<int64_t> index;
  explicit RowArgmax(int64_t rows) : value(rows, -INFINITY), index(rows, 0) {}
  // the C tile of rows [m0, m0 + 16) × columns [n0, n0 + 16), + bias
  void take(const float* acc, int64_t m0, const uint16_t* bias, int64_t n0) {
    const int64_t rows = std::min<int64_t>(kTileRows, static_cast<int64_t>(value.size()) - m0);
    alignas(32) float v[kTileN];
    for (int64_t r = 0; r < rows; ++r) {
      for (int h = 0; h < 2; ++h) {
        __m256 x = simd::load8(acc + r * kTileN + 8 * h);
        if (bias) x = _mm256_add_ps(x, simd::load8(bias + 8 * h));
        _mm256_store_ps(v + 8 * h, simd::round_bf16(x));
      }
      for (int64_t n = 0; n < kTileN; ++n)
        if (v[n] > value[m0 + r]) value[m0 + r] = v[n], index[m0 + r] = n0 + n;
    }
  }
  void fold(float* slot_value, int64_t* slot_index) const {
    for (size_t m = 0; m < value.size(); ++m)
      if (better(value[m], index[m], slot_value[m], slot_index[m])) slot_value[m] = value[m], slot_index[m] = index[m];
  }
};

}  // namespace

// Linux hands out the 8 KiB tile state only on request, once per process.
bool granted() {
  static const bool ok = [] {
    unsigned eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
    if (!amx_bf16 || !amx_tile) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

void linear(const uint16_t* xp, int64_t M, int64_t K, const uint16_t* wp, int64_t NB, const uint16_t* bp,
            Epilogue epilogue, uint16_t* yp, int64_t* argmax_out) {
  if (M <= 0) return;
  const bool silu_mul = epilogue == Epilogue::kSiluMul, argmax = epilogue == Epilogue::kArgmax;
  const int64_t KB = K / kTileK, N = NB * kTileN, N_out = silu_mul ? N / 2 : N;
  const int64_t Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t x_stride = K * 2, block_elems = KB * kTileRows * kTileK, m_tiles = Mp / kTileRows;
  // one C tile (16 rows of x × one column block) out to y: + bias in fp32, rounded to bf16
  auto store_tile = [&](const float* acc, int64_t m_tile, int64_t nb) {
    for (int r = 0; r < kTileRows; ++r) {
      const int64_t m = m_tile * kTileRows + r;
      if (m >= M) break;
      store_row(acc + r * kTileN, bp ? bp + nb * kTileN : nullptr, yp + m * N + nb * kTileN);
    }
  };
  // the C tiles of gate block p and up block p (same 16 rows) out to y as silu(gate)·up, both
  // rounded to bf16 first as the unfused path stores them, silu rounded before the product
  auto store_pair = [&](const float* gate, const float* up, int64_t m_tile, int64_t p) {
    for (int r = 0; r < kTileRows; ++r) {
      const int64_t m = m_tile * kTileRows + r;
      if (m >= M) break;
      for (int h = 0; h < 2; ++h) {
        const __m256 g = simd::round_bf16(simd::load8(gate + r * kTileN + 8 * h));
        const __m256 u = simd::round_bf16(simd::load8(up + r * kTileN + 8 * h));
        simd::store8(yp + m * N_out + p * kTileN + 8 * h, _mm256_mul_ps(simd::round_bf16(simd::silu8(g)), u));
      }
    }
  };
  // up to 4 A tiles (from row tile t0) against one column block, over depth blocks
  // [kb0, kb0 + nkb), as one column_block call; returns the tiles
  auto compute_group = [&](int64_t t0, int64_t t_end, int64_t nb, const char* pf, float (*acc)[kTileFloats],
                           int64_t kb0, int64_t nkb, bool accumulate) {
    const int tiles = static_cast<int>(std::min<int64_t>(kGroupTiles, t_end - t0));
    const uint16_t* xa = xp + t0 * kTileRows * K + kb0 * kTileK;
    const uint16_t* wblock = wp + nb * block_elems + kb0 * kTileRows * kTileK;
    switch (tiles) {
      case 1: column_block<1>(xa, x_stride, wblock, pf, nkb, acc, accumulate); break;
      case 2: column_block<2>(xa, x_stride, wblock, pf, nkb, acc, accumulate); break;
      case 3: column_block<3>(xa, x_stride, wblock, pf, nkb, acc, accumulate); break;
      default: column_block<4>(xa, x_stride, wblock, pf, nkb, acc, accumulate); break;
    }
    return tiles;
  };
  auto group = [&](int64_t t0, int64_t t_end, int64_t nb, float (*acc)[kTileFloats]) {
    const int tiles = compute_group(t0, t_end, nb, nullptr, acc, 0, KB, false);
    for (int t = 0; t < tiles; ++t) store_tile(acc[t], t0 + t, nb);
  };
  // threads split the column blocks in units: one block, or with silu_mul a gate block and its
  // up block, so both halves of an output block meet in one thread
  const int64_t unit_blocks = silu_mul ? 2 : 1, units = NB / unit_blocks;
  const int64_t threads = omp_get_max_threads();
  if (m_tiles <= kSmallTiles) {
    // Decode-sized x: each weight tile is read once, from memory, for all rows of x. The A
    // tiles are reloaded for every column block, so they must come from L1 (x of 64 rows × 576
    // features is 72 KiB, L1 48 KiB): in a scratch loop of 4 products per weight tile, A from
    // L2 took 16 ns a product, A and B from L1 6 ns. So depth is cut into chunks whose A tiles
    // fit in L1 (kChunkATiles), and a group of column blocks goes through the chunks one after
    // another, its partial C tiles parked in `part`. The 30 layers' decode linears at 64 rows:
    // 21.1 -> 18.2 ms; the LM head 5.0 -> 3.9 ms.
    const int64_t row_group = std::min<int64_t>(kGroupTiles, m_tiles);
    const int64_t chunks = (KB * row_group + kChunkATiles - 1) / kChunkATiles, kc = (KB + chunks - 1) / chunks;
    // argmax: each thread keeps per row the best value and its column, then folds them into
    // its slot of best_value / best_index; the slots are merged at the end
    const int64_t slots = argmax ? threads : 0;
    std::vector<float> best_value(slots * M, -INFINITY);
    std::vector<int64_t> best_index(slots * M, INT64_MAX);
    // Work items of group_units units (about 1/16 of the call's) go to whichever thread asks
    // next: with a static split one thread waited at the end of each decode linear for 6-22%
    // of the call (the two cores read memory at different speeds, more so when the host is
    // busy). Each thread reserves its next item as it starts one, so its prefetch runs on into
    // the item it does next.
    const int64_t group_units = std::clamp<int64_t>((units + 8 * threads - 1) / (8 * threads), 1, kGroupUnits);
    const int64_t items = (units + group_units - 1) / group_units;
    std::atomic<int64_t> next_item{0};
#pragma omp parallel num_threads(threads)
    {
      configure_full_tiles(kTilesUsed);
      RowArgmax row_argmax(argmax ? M : 0);
      const int64_t group_blocks = group_units * unit_blocks;
      std::vector<float> part_store(group_blocks * kGroupTiles * kTileFloats + 16);
      auto* part = reinterpret_cast<float (*)[kGroupTiles][kTileFloats]>(
          (reinterpret_cast<uintptr_t>(part_store.data()) + 63) & ~uintptr_t(63));
      auto item_blocks = [&](int64_t item) { return std::min(group_blocks, NB - item * group_blocks); };
      // the weights of step s (chunk s / blocks, block s % blocks) of `item`, or past its end of
      // `upcoming`: where the prefetch a few steps ahead of the first row group points
      auto step_weights = [&](int64_t item, int64_t upcoming, int64_t s) -> const char* {
        int64_t blocks = item_blocks(item);
        if (s >= chunks * blocks) {
          if (upcoming >= items) return nullptr;
          s -= chunks * blocks;
          item = upcoming;
          blocks = item_blocks(item);
          if (s >= chunks * blocks) return nullptr;
        }
        const int64_t nb = item * group_blocks + s % blocks;
        return reinterpret_cast<const char*>(wp + nb * block_elems + (s / blocks) * kc * kTileRows * kTileK);
      };
      int64_t item = next_item.fetch_add(1);
      while (item < items) {
        const int64_t upcoming = next_item.fetch_add(1);
        const int64_t nb0 = item * group_blocks, blocks = item_blocks(item);
        for (int64_t t0 = 0; t0 < m_tiles; t0 += kGroupTiles) {
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t kb0 = c * kc, nkb = std::min(kc, KB - kb0);
            for (int64_t j = 0; j < blocks; ++j) {
              // weights come from memory on the first row group only
              const char* pf = t0 == 0 ? step_weights(item, upcoming, c * blocks + j + kPrefetchBlocks) : nullptr;
              const int tiles = compute_group(t0, m_tiles, nb0 + j, pf, part[j], kb0, nkb, c > 0);
              if (c + 1 < chunks || (j + 1) % unit_blocks) continue;
              // the unit's last block has its sums: out to y
              const int64_t u = (nb0 + j) / unit_blocks;
              for (int t = 0; t < tiles; ++t) {
                if (silu_mul) store_pair(part[j - 1][t], part[j][t], t0 + t, u);
                else if (argmax) row_argmax.take(part[j][t], (t0 + t) * kTileRows, bp ? bp + u * kTileN : nullptr, u * kTileN);
                else store_tile(part[j][t], t0 + t, u);
              }
            }
          }
        }
        item = upcoming;
      }
      _tile_release();
      if (argmax) row_argmax.fold(best_value.data() + omp_get_thread_num() * M, best_index.data() + omp_get_thread_num() * M);
    }
    if (argmax)
      for (int64_t m = 0; m < M; ++m) {
        float v = -INFINITY;
        int64_t i = 0;
        for (int64_t t = 0; t < slots; ++t)
          if (better(best_value[t * M + m], best_index[t * M + m], v, i)) v = best_value[t * M + m], i = best_index[t * M + m];
        argmax_out[m] = i;
      }
    return;
  }
  // larger x: panels of kPanelTiles A tiles stay in L2 while this thread's column blocks pass
  // over them in pairs, 32 rows at a time (column_pair's 2×2 grid of C tiles; with silu_mul each
  // pair is one unit). Threads take contiguous runs of pairs of blocks.
#pragma omp parallel num_threads(threads)
  {
    const int64_t T = omp_get_num_threads(), th = omp_get_thread_num();
    const int64_t pairs = (units * unit_blocks + 1) / 2;  // of column blocks
    const int64_t nb_begin = std::min(NB, 2 * (pairs * th / T)), nb_end = std::min(NB, 2 * (pairs * (th + 1) / T));
    configure_full_tiles(kTilesUsed);
    alignas(64) float acc[kGroupTiles][kTileFloats];
    for (int64_t p0 = 0; p0 < m_tiles; p0 += kPanelTiles) {
      const int64_t p1 = std::min(m_tiles, p0 + kPanelTiles);
      int64_t nb = nb_begin;
      for (; nb + 1 < nb_end; nb += 2) {
        int64_t t = p0;
        for (; t + 1 < p1; t += 2) {
          column_pair(xp + t * kTileRows * K, x_stride, wp + nb * block_elems, wp + (nb + 1) * block_elems, KB, acc);
          if (silu_mul) {
            store_pair(acc[0], acc[1], t, nb / 2);
            store_pair(acc[2], acc[3], t + 1, nb / 2);
          } else {
            store_tile(acc[0], t, nb);
            store_tile(acc[1], t, nb + 1);
            store_tile(acc[2], t + 1, nb);
            store_tile(acc[3], t + 1, nb + 1);
          }
        }
        if (t < p1) {  // an odd last A tile of the panel
          if (silu_mul) {
            compute_group(t, p1, nb, nullptr, acc, 0, KB, false);
            compute_group(t, p1, nb + 1, nullptr, acc + 1, 0, KB, false);
            store_pair(acc[0], acc[1], t, nb / 2);
          } else {
            group(t, p1, nb, acc);
            group(t, p1, nb + 1, acc);
          }
        }
      }
      if (nb < nb_end)  // an odd last column block (never with silu_mul: its blocks come in pairs)
        for (int64_t t0 = p0; t0 < p1; t0 += kGroupTiles) group(t0, p1, nb, acc);
    }
    _tile_release();
  }
}

}  // namespace amx
}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
