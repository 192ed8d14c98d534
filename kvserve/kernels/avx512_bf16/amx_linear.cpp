// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias) in bf16 on Intel AMX tiles, for batched decode
// and mixed steps (linear() in linear.cpp sends it the rows past the GEMV's, up to a
// Projection's amx_max_rows).
//
// Why our own: at these M, oneDNN's packed GEMM runs at ~1.2 TFLOP/s when its weights sit
// in cache but only at ~9 GB/s of weights when they come from memory, as they do in a
// decode step (every layer's weights are touched once per step). This kernel streams each
// weight tile exactly once per 64 rows of x, in the order it is stored, and prefetches the
// tiles it will need a few column blocks ahead (in the 64-request decode step it reads
// ~16 GB/s of weights, against ~9 for oneDNN; the host's probe sees 16-34 GB/s). For the
// MLP, amx_linear_silu_mul applies silu(gate)·up as the tiles leave the accumulators.
//
// Weight layout ("VNNI tiles", built once by amx_pack_weight): for column block nb (16
// output columns) and depth block kb (32 input features), one 1 KiB tile whose row kp holds,
// for each of the 16 columns n, the pair (w[16nb + n][32kb + 2kp], w[16nb + n][32kb + 2kp + 1])
// — the B operand layout of TDPBF16PS. Tiles are stored nb-major, so one column block's
// K/32 tiles are contiguous.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "../kernels.h"
#include "vec_math.h"

#if KVSERVE_AMX
KVSERVE_KERNEL_FAMILY("amx_linear");
#endif

namespace {

constexpr int kTileRows = 16;    // rows of x per A tile, K pairs per B tile
constexpr int kTileK = kWeightTileK;    // bf16 input features per tile (32)
constexpr int kTileN = kWeightTileRows; // output columns per column block (16)
constexpr int kGroupTiles = 4;   // A tiles (64 rows of x) per pass over a weight tile
constexpr int64_t kSmallTiles = 8;   // up to 128 rows of x: the decode-shaped loop
static_assert(kSmallTiles * kTileRows == kAmxArgmaxMaxRows, "amx_linear_argmax runs in the decode-shaped loop only");
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
// within noise, 64 slower. Storing the weights chunk-major, so that each thread's reads
// form one sequential stream, was no faster.
constexpr int64_t kChunkATiles = 24;
constexpr int64_t kGroupUnits = 16;

// Tiles 0-3: the four C accumulators (16 rows × 16 fp32); 4, 5: A (16 rows × 32 bf16) or,
// in column_block, A and B; 6, 7: B in column_pair.
constexpr int kTilesUsed = 8;

inline void store_row(const float* acc, const at::BFloat16* bias, at::BFloat16* y) {
  __m512 v = _mm512_loadu_ps(acc);
  if (bias) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias));
    v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}

// One column block against `tiles` (1..4) A tiles, over depth blocks [0, KB) of the pointers
// given. The C tiles start from zero, or with `accumulate` from acc (an earlier depth
// chunk's partial sums), and end in acc.
template <int Tiles>
void column_block(const at::BFloat16* x, int64_t x_stride_bytes, const at::BFloat16* wblock, const char* prefetch,
                  int64_t KB, float (*acc)[kTileRows * kTileN], bool accumulate = false) {
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
  for (int64_t kb = 0; kb < KB; ++kb) {
    if (prefetch)
      for (int line = 0; line < 16; ++line) _mm_prefetch(prefetch + kb * 1024 + line * 64, _MM_HINT_T1);
    _tile_loadd(5, wblock + kb * kTileRows * kTileK, 64);
    const at::BFloat16* a = x + kb * kTileK;
    const int64_t tile_step = kTileRows * x_stride_bytes / 2;
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
// loaded feeds two products (column_block's 4×1 grid reloads A for every product, which
// is fine while the weights are the bottleneck but not when x is large and they are hot).
void column_pair(const at::BFloat16* x, int64_t x_stride_bytes, const at::BFloat16* w0, const at::BFloat16* w1,
                 int64_t KB, float (*acc)[kTileRows * kTileN]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t tile_step = kTileRows * x_stride_bytes / 2;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const at::BFloat16* a = x + kb * kTileK;
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

}  // namespace

// Linux hands out the 8 KiB tile state only on request, once per process.
bool amx_available() {
  if (!KVSERVE_AMX) return false;  // the avx512-bf16 build: no AMX code in it
  static const bool ok = [] {
    if (!__builtin_cpu_supports("avx512f")) return false;
    unsigned eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
    if (!amx_bf16 || !amx_tile) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// w [N, K] bf16 → VNNI tiles [N/16, K/32, 16, 32] (see the layout note above).
at::Tensor amx_pack_weight(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "amx_pack_weight: [N, K] bf16");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kTileN == 0 && K % kTileK == 0, "amx_pack_weight: N % ", kTileN, " == 0 and K % ", kTileK, " == 0, got ", N, "x", K);
  return w.contiguous()
      .view({N / kTileN, kTileN, K / kTileK, kTileRows, 2})
      .permute({0, 2, 3, 1, 4})
      .contiguous()
      .view({N / kTileN, K / kTileK, kTileRows, kTileK});
}

namespace {

// (value a, index ia) beats (b, ib): larger, or as large with a lower index; NaN never wins
// (as in argmax_rows, whose running max compares with >, false for NaN).
inline bool better(float a, int64_t ia, float b, int64_t ib) { return a > b || (a == b && ia < ib); }

// One thread's running argmax per row of x over the column blocks it computes: per lane the
// best bf16-rounded value so far and its column (a strictly greater value replaces it, so
// a tie keeps the earlier, lower column; blocks arrive in increasing order).
struct RowArgmax {
  std::vector<__m512> value;
  std::vector<__m512i> index;
  explicit RowArgmax(int64_t rows) : value(rows, _mm512_set1_ps(-INFINITY)), index(rows, _mm512_setzero_si512()) {}
  // the C tile of rows [m0, m0 + 16) × columns [n0, n0 + 16), + bias
  void take(const float* acc, int64_t m0, const at::BFloat16* bias, int64_t n0) {
    const __m512i column = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(n0)),
                                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512 b = bias ? load16(bias) : _mm512_setzero_ps();
    const int64_t rows = std::min<int64_t>(kTileRows, static_cast<int64_t>(value.size()) - m0);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v = round_bf16(_mm512_add_ps(_mm512_loadu_ps(acc + r * kTileN), b));
      const __mmask16 gt = _mm512_cmp_ps_mask(v, value[m0 + r], _CMP_GT_OQ);
      value[m0 + r] = _mm512_mask_mov_ps(value[m0 + r], gt, v);
      index[m0 + r] = _mm512_mask_mov_epi32(index[m0 + r], gt, column);
    }
  }
  // lanes reduced, then merged into this thread's slot
  void fold(float* slot_value, int64_t* slot_index) const {
    for (size_t m = 0; m < value.size(); ++m) {
      const float v = _mm512_reduce_max_ps(value[m]);
      const __mmask16 at_max = _mm512_cmp_ps_mask(value[m], _mm512_set1_ps(v), _CMP_EQ_OQ);
      // all lanes -inf (or NaN): column 0, as argmax_rows gives
      const int64_t i = at_max ? _mm512_mask_reduce_min_epi32(at_max, index[m]) : 0;
      if (better(v, i, slot_value[m], slot_index[m])) slot_value[m] = v, slot_index[m] = i;
    }
  }
};

// What leaves the accumulators: y itself; silu(gate)·up; or only each row's argmax.
enum class Epilogue { kStore, kSiluMul, kArgmax };

// y = x·Wᵀ (+ bias) with W packed by amx_pack_weight. With kSiluMul, W is the gate and up
// projections with their 16-column blocks interleaved (gate block p, then up block p: see
// interleave_gate_up in kvserve/kernels/layouts.py) and y = silu(gate) · up, [M, N/2]. Both
// halves of a pair are rounded to bf16 first, as the unfused path stores them, so the
// result is bitwise that of amx_linear followed by silu_and_mul — without writing the
// [M, N] gate/up product and reading it back, and without the separate pass over it.
// With kArgmax (decode-sized x only), the result is each row's argmax over the bf16-rounded
// outputs, int64 [M], lowest index on ties: bitwise argmax_rows(amx_linear(x)), without
// writing the [M, N] product (for the LM head, 6 MiB of logits per 64-row step).
at::Tensor amx_run(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                   Epilogue epilogue) {
  const bool silu_mul = epilogue == Epilogue::kSiluMul, argmax = epilogue == Epilogue::kArgmax;
  TORCH_CHECK(amx_available(), "amx_linear: AMX-BF16 is not available on this CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "amx_linear: bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTileRows && packed.size(3) == kTileK, "amx_linear: packed layout");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KB = packed.size(1), N = NB * kTileN;
  TORCH_CHECK(K == KB * kTileK, "amx_linear: x has ", K, " features, the weight ", KB * kTileK);
  TORCH_CHECK(!bias || (bias->numel() == N && bias->scalar_type() == at::kBFloat16), "amx_linear: bias");
  TORCH_CHECK(!silu_mul || (NB % 2 == 0 && !bias), "amx_linear_silu_mul: gate/up block pairs, no bias");
  const int64_t N_out = silu_mul ? N / 2 : N;
  TORCH_CHECK(!argmax || M <= kAmxArgmaxMaxRows, "amx_linear_argmax: at most ", kAmxArgmaxMaxRows, " rows");
  auto y = argmax ? at::empty({M}, x.options().dtype(at::kLong)) : at::empty({M, N_out}, x.options());
  if (M == 0) return y;
  // A tiles read 16 whole rows: pad x to a multiple of 16 rows (zeros) when it is not one
  const int64_t Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  at::Tensor xs = x.contiguous();
  if (Mp != M) {
    xs = at::zeros({Mp, K}, x.options());
    xs.narrow(0, 0, M).copy_(x);
  }
  const auto* xp = xs.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  const at::Tensor bias_c = bias ? bias->contiguous() : at::Tensor();  // kept alive for bp
  const at::BFloat16* bp = bias ? bias_c.data_ptr<at::BFloat16>() : nullptr;
  auto* yp = argmax ? nullptr : y.data_ptr<at::BFloat16>();
  const int64_t x_stride = K * 2, block_elems = KB * kTileRows * kTileK, m_tiles = Mp / kTileRows;
  // one C tile (16 rows of x × one column block) out to y: + bias in fp32, rounded to bf16
  auto store_tile = [&](const float* acc, int64_t m_tile, int64_t nb) {
    for (int r = 0; r < kTileRows; ++r) {
      const int64_t m = m_tile * kTileRows + r;
      if (m >= M) break;
      store_row(acc + r * kTileN, bp ? bp + nb * kTileN : nullptr, yp + m * N + nb * kTileN);
    }
  };
  // the C tiles of gate block p and up block p (same 16 rows) out to y as silu(gate) · up
  auto store_pair = [&](const float* gate, const float* up, int64_t m_tile, int64_t p) {
    for (int r = 0; r < kTileRows; ++r) {
      const int64_t m = m_tile * kTileRows + r;
      if (m >= M) break;
      const __m512 g = round_bf16(_mm512_loadu_ps(gate + r * kTileN)), u = round_bf16(_mm512_loadu_ps(up + r * kTileN));
      store16(yp + m * N_out + p * kTileN, silu_mul16(g, u, true));
    }
  };
  // up to 4 A tiles (from row tile t0) against one column block, over depth blocks
  // [kb0, kb0 + nkb), as one column_block call; returns the tiles
  auto compute_group = [&](int64_t t0, int64_t t_end, int64_t nb, const char* pf, float (*acc)[kTileRows * kTileN],
                           int64_t kb0 = 0, int64_t nkb = -1, bool accumulate = false) {
    const int tiles = static_cast<int>(std::min<int64_t>(kGroupTiles, t_end - t0));
    const at::BFloat16* xa = xp + t0 * kTileRows * K + kb0 * kTileK;
    const at::BFloat16* wblock = wp + nb * block_elems + kb0 * kTileRows * kTileK;
    if (nkb < 0) nkb = KB;
    switch (tiles) {
      case 1: column_block<1>(xa, x_stride, wblock, pf, nkb, acc, accumulate); break;
      case 2: column_block<2>(xa, x_stride, wblock, pf, nkb, acc, accumulate); break;
      case 3: column_block<3>(xa, x_stride, wblock, pf, nkb, acc, accumulate); break;
      default: column_block<4>(xa, x_stride, wblock, pf, nkb, acc, accumulate); break;
    }
    return tiles;
  };
  auto group = [&](int64_t t0, int64_t t_end, int64_t nb, const char* pf, float (*acc)[kTileRows * kTileN]) {
    const int tiles = compute_group(t0, t_end, nb, pf, acc);
    for (int t = 0; t < tiles; ++t) store_tile(acc[t], t0 + t, nb);
  };
  // threads split the column blocks in units: one block, or with silu_mul a gate block and
  // its up block, so both halves of an output block meet in one thread
  const int64_t unit_blocks = silu_mul ? 2 : 1, units = NB / unit_blocks;
  if (m_tiles <= kSmallTiles) {
    // Decode-sized x: each weight tile is read once, from memory, for all rows of x. The A
    // tiles are reloaded for every column block, so they must come from L1 (x of 64 rows ×
    // 576 features is 72 KiB, L1 48 KiB): in a scratch loop of 4 products per weight tile,
    // A from L2 took 16 ns a product, A and B from L1 6 ns. So depth is cut into chunks
    // whose A tiles fit in L1 (kChunkATiles), and a group of column blocks goes through the
    // chunks one after another, its partial C tiles parked in `part`. The 30 layers'
    // decode linears at 64 rows: 21.1 -> 18.2 ms; the LM head 5.0 -> 3.9 ms.
    const int64_t row_group = std::min<int64_t>(kGroupTiles, m_tiles);
    const int64_t chunks = (KB * row_group + kChunkATiles - 1) / kChunkATiles, kc = (KB + chunks - 1) / chunks;
    // argmax: each thread keeps per row and lane the best value and its column, then folds
    // them into its slot of best_value / best_index; the slots are merged at the end
    const int64_t slots = argmax ? at::get_num_threads() : 0;
    std::vector<float> best_value(slots * M, -INFINITY);
    std::vector<int64_t> best_index(slots * M, INT64_MAX);
    // Work items of group_units units (about 1/16 of the call's) go to whichever thread asks
    // next. With a static split, one thread waited at the end of each decode linear for
    // 6-22% of the call: the two cores read memory at different speeds, more so when the
    // host is busy (the threads start within 2-9 us of each other). Whole 64x128/128
    // workload, alternating in one process on a loaded host: 9 rounds of 12 faster, ~5%
    // on average; on a quiet one, the decode linears within noise. Each thread reserves
    // its next item as it starts one, so its prefetch runs on into the item it does next.
    const int64_t threads = at::get_num_threads();
    const int64_t group_units = std::clamp<int64_t>((units + 8 * threads - 1) / (8 * threads), 1, kGroupUnits);
    const int64_t items = (units + group_units - 1) / group_units;
    std::atomic<int64_t> next_item{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      configure_full_tiles(kTilesUsed);
      RowArgmax row_argmax(argmax ? M : 0);
      thread_local std::vector<float> part_store;
      const int64_t tile_floats = kTileRows * kTileN, group_blocks = group_units * unit_blocks;
      part_store.resize(group_blocks * kGroupTiles * tile_floats + 16);
      auto* part = reinterpret_cast<float (*)[kGroupTiles][kTileRows * kTileN]>(
          (reinterpret_cast<uintptr_t>(part_store.data()) + 63) & ~uintptr_t(63));
      auto item_blocks = [&](int64_t item) { return std::min(group_blocks, NB - item * group_blocks); };
      // the weights of step s (chunk s / blocks, block s % blocks) of `item`, or past its end
      // of `upcoming`: where the prefetch a few steps ahead of the first row group points
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
      if (argmax) {
        const int64_t slot = at::get_thread_num();
        TORCH_CHECK(slot < slots, "amx_linear_argmax: thread ", slot, " of ", slots);
        row_argmax.fold(best_value.data() + slot * M, best_index.data() + slot * M);
      }
    });
    if (argmax) {
      auto* out = y.data_ptr<int64_t>();
      for (int64_t m = 0; m < M; ++m) {
        float v = -INFINITY;
        int64_t i = 0;
        for (int64_t t = 0; t < slots; ++t)
          if (better(best_value[t * M + m], best_index[t * M + m], v, i)) v = best_value[t * M + m], i = best_index[t * M + m];
        out[m] = i;
      }
    }
    return y;
  }
  // larger x: panels of kPanelTiles A tiles stay in L2 while this thread's column blocks
  // pass over them in pairs, 32 rows at a time (column_pair's 2×2 grid of C tiles; with
  // silu_mul each pair is one unit)
  at::parallel_for(0, units, 2 / unit_blocks, [&](int64_t u_begin, int64_t u_end) {
    const int64_t nb_begin = u_begin * unit_blocks, nb_end = u_end * unit_blocks;
    configure_full_tiles(kTilesUsed);
    alignas(64) float acc[kGroupTiles][kTileRows * kTileN];
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
            compute_group(t, p1, nb, nullptr, acc);
            compute_group(t, p1, nb + 1, nullptr, acc + 1);
            store_pair(acc[0], acc[1], t, nb / 2);
          } else {
            group(t, p1, nb, nullptr, acc);
            group(t, p1, nb + 1, nullptr, acc);
          }
        }
      }
      if (nb < nb_end)  // an odd last column block of this thread's range (never with silu_mul)
        for (int64_t t0 = p0; t0 < p1; t0 += kGroupTiles) group(t0, p1, nb, nullptr, acc);
    }
    _tile_release();
  });
  return y;
}

}  // namespace

// x [M, K] bf16, packed from amx_pack_weight, bias [N] or empty → y [M, N] bf16.
at::Tensor amx_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  return amx_run(x, packed, bias, Epilogue::kStore);
}

// x [M, K], the gate/up projection packed with its blocks interleaved → silu(gate) · up [M, N/2]
at::Tensor amx_linear_silu_mul(at::Tensor x, at::Tensor packed) {
  return amx_run(x, packed, c10::nullopt, Epilogue::kSiluMul);
}

// x [M, K] (M <= kAmxArgmaxMaxRows), packed from amx_pack_weight, bias [N] or empty → argmax over each
// row of x·Wᵀ (+ bias) rounded to bf16, int64 [M]: bitwise argmax_rows(amx_linear(x, ...)).
at::Tensor amx_linear_argmax(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  return amx_run(x, packed, bias, Epilogue::kArgmax);
}
