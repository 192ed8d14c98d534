// y[M, N] = x[M, K] · w[N, K]ᵀ (+ bias) in bf16 on Intel AMX tiles, for batched decode
// steps (M from ~9 to a few hundred rows).
//
// Why our own: at these M, oneDNN's packed GEMM runs at ~1.2 TFLOP/s when its weights sit
// in cache but only at ~9 GB/s of weights when they come from memory, as they do in a
// decode step (every layer's weights are touched once per step). This kernel streams each
// weight tile exactly once per 64 rows of x, in the order it is stored, and prefetches the
// tiles it will need a few column blocks ahead, so the step is bound by memory bandwidth
// rather than by memory latency.
//
// Weight layout ("VNNI tiles", built once by amx_pack_weight): for column block nb (16
// output columns) and depth block kb (32 input features), one 1 KiB tile whose row kp holds,
// for each of the 16 columns n, the pair (w[16nb + n][32kb + 2kp], w[16nb + n][32kb + 2kp + 1])
// — the B operand layout of TDPBF16PS. Tiles are stored nb-major, so one column block's
// K/32 tiles are contiguous.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstring>

namespace {

constexpr int kTileRows = 16;    // rows of x per A tile, K pairs per B tile
constexpr int kTileK = 32;       // bf16 input features per tile
constexpr int kTileN = 16;       // output columns per column block
constexpr int kGroupTiles = 4;   // A tiles (64 rows of x) per pass over a weight tile
// Column blocks whose weights are prefetched (into L2) while one computes. Measured in the
// 64-request decode step: no prefetch ~10% slower; 1, 2 or 4 blocks, to L1 or L2, within noise.
constexpr int kPrefetchBlocks = 2;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: the four C accumulators (16 rows × 16 fp32); 4: A (16 rows × 32 bf16); 5: B.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

inline void store_row(const float* acc, const at::BFloat16* bias, at::BFloat16* y) {
  __m512 v = _mm512_loadu_ps(acc);
  if (bias) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias));
    v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}

// One column block against `tiles` (1..4) A tiles starting at row `m0`, all of K.
template <int Tiles>
void column_block(const at::BFloat16* x, int64_t x_stride_bytes, const at::BFloat16* wblock, const char* prefetch,
                  int64_t KB, float (*acc)[kTileRows * kTileN]) {
  _tile_zero(0);
  if constexpr (Tiles > 1) _tile_zero(1);
  if constexpr (Tiles > 2) _tile_zero(2);
  if constexpr (Tiles > 3) _tile_zero(3);
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

}  // namespace

// True when this CPU has AMX-BF16 and the kernel let this process use the tile registers
// (Linux hands out the 8 KiB tile state only on request, once per process).
bool amx_available() {
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
torch::Tensor amx_pack_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "amx_pack_weight: [N, K] bf16");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kTileN == 0 && K % kTileK == 0, "amx_pack_weight: N % 16 == 0 and K % 32 == 0, got ", N, "x", K);
  return w.contiguous()
      .view({N / kTileN, kTileN, K / kTileK, kTileRows, 2})
      .permute({0, 2, 3, 1, 4})
      .contiguous()
      .view({N / kTileN, K / kTileK, kTileRows, kTileK});
}

// x [M, K] bf16, packed from amx_pack_weight, bias [N] or empty → y [M, N] bf16.
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(amx_available(), "amx_linear: AMX-BF16 is not available on this CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "amx_linear: bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTileRows && packed.size(3) == kTileK, "amx_linear: packed layout");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KB = packed.size(1), N = NB * kTileN;
  TORCH_CHECK(K == KB * kTileK, "amx_linear: x has ", K, " features, the weight ", KB * kTileK);
  TORCH_CHECK(!bias || (bias->numel() == N && bias->scalar_type() == at::kBFloat16), "amx_linear: bias");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  // A tiles read 16 whole rows: pad x to a multiple of 16 rows (zeros) when it is not one
  const int64_t Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  torch::Tensor xs = x.contiguous();
  if (Mp != M) {
    xs = torch::zeros({Mp, K}, x.options());
    xs.narrow(0, 0, M).copy_(x);
  }
  const auto* xp = xs.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = bias ? bias->contiguous().data_ptr<at::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t x_stride = K * 2, block_elems = KB * kTileRows * kTileK, m_tiles = Mp / kTileRows;
  at::parallel_for(0, NB, 1, [&](int64_t nb_begin, int64_t nb_end) {
    configure_tiles();
    alignas(64) float acc[kGroupTiles][kTileRows * kTileN];
    for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
      const at::BFloat16* wblock = wp + nb * block_elems;
      const char* pf = nb + kPrefetchBlocks < nb_end
                           ? reinterpret_cast<const char*>(wp + (nb + kPrefetchBlocks) * block_elems) : nullptr;
      for (int64_t t0 = 0; t0 < m_tiles; t0 += kGroupTiles) {
        const int tiles = static_cast<int>(std::min<int64_t>(kGroupTiles, m_tiles - t0));
        const at::BFloat16* xa = xp + t0 * kTileRows * K;
        const char* pf_here = t0 == 0 ? pf : nullptr;  // weights are fetched on the first pass only
        switch (tiles) {
          case 1: column_block<1>(xa, x_stride, wblock, pf_here, KB, acc); break;
          case 2: column_block<2>(xa, x_stride, wblock, pf_here, KB, acc); break;
          case 3: column_block<3>(xa, x_stride, wblock, pf_here, KB, acc); break;
          default: column_block<4>(xa, x_stride, wblock, pf_here, KB, acc); break;
        }
        for (int t = 0; t < tiles; ++t)
          for (int r = 0; r < kTileRows; ++r) {
            const int64_t m = (t0 + t) * kTileRows + r;
            if (m >= M) break;
            store_row(acc[t] + r * kTileN, bp ? bp + nb * kTileN : nullptr, yp + m * N + nb * kTileN);
          }
      }
    }
    _tile_release();
  });
  return y;
}
