// The gemv family's torch layer (kvserve/kernels/core/gemv_core.cpp): gemv_bf16 on the
// row-major weight, gemv_vnni and gemm_vnni on its VNNI-tile copy, and amx_pack_weight, the
// layout transform that makes the copy (no AMX instruction: the same tiles the AMX level's
// kernel reads, and which every level's GEMV reads).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <atomic>

#include "../core/gemv.h"
#include "../kernels.h"

KVSERVE_KERNEL_FAMILY("gemv");

namespace gemv_core = kvserve::KVSERVE_LEVEL_NS::gemv;

static_assert(gemv_core::kTileN == kWeightTileRows && gemv_core::kTileK == kWeightTileK, "the core's VNNI tiles are kernels.h's");

namespace {

// Whether this process's bf16 GEMMs on the VNNI tiles take VDPBF16PS pair dots (the levels that
// have them) or widen to fp32 FMAs: set once at load (kvserve/kernels/isa.py bf16_pair_dots
// says which pays on this CPU), the same for every call so that a row's bits never depend on
// the call it lands in.
std::atomic<bool> g_pair_dots{kvserve::KVSERVE_LEVEL_NS::simd::kBf16Dot};

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bits_out(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_rows(const char* name, int64_t M) {
  TORCH_CHECK(M >= 1 && M <= kGemvMaxRows, name, ": 1 <= M <= ", kGemvMaxRows, ", got ", M);
}

// x [M, K] against packed [N/16, K/32, 16, 32]: the checks gemv_vnni and gemm_vnni share
void check_packed(const char* name, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, name, ": bf16 only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kWeightTileRows && packed.size(3) == kWeightTileK &&
                  packed.is_contiguous(),
              name, ": packed must come from amx_pack_weight");
  TORCH_CHECK(x.dim() == 2, name, ": x must be [M, K], got ", x.dim(), " dimensions");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.size(1) * kWeightTileK == K, name, ": x has ", K, " features, the weight ",
              packed.size(1) * kWeightTileK);
}

at::Tensor run_tiles(at::Tensor x, const at::Tensor& packed) {
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kWeightTileRows;
  auto y = at::empty({M, N}, x.options());
  if (M > 0) gemv_core::gemm_tiles(bits(x), bits(packed), bits_out(y), M, K, N, g_pair_dots.load(std::memory_order_relaxed));
  return y;
}

}  // namespace

bool set_bf16_pair_dots(bool on) {
  g_pair_dots.store(on && kvserve::KVSERVE_LEVEL_NS::simd::kBf16Dot);
  return g_pair_dots.load();
}

bool bf16_pair_dots() { return g_pair_dots.load(); }

// y[M, N] = x[M, K] · w[N, K]ᵀ, 1 <= M <= kGemvMaxRows, bf16, w row-major
at::Tensor gemv_bf16(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16: bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_bf16: shapes");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_rows("gemv_bf16", M);
  auto y = at::empty({M, N}, x.options());
  gemv_core::gemv_rowmajor(bits(x), bits(w), bits_out(y), M, K, N);
  return y;
}

// x: [M <= kGemvMaxRows, K] bf16; packed: amx_pack_weight(w) for w [N, K]. Returns [M, N] bf16.
at::Tensor gemv_vnni(at::Tensor x, at::Tensor packed) {
  check_packed("gemv_vnni", x, packed);
  check_rows("gemv_vnni", x.size(0));
  return run_tiles(x, packed);
}

// x: [M, K] bf16, any M; packed: amx_pack_weight(w). Returns [M, N] bf16, each row bitwise
// what gemv_vnni gives it (one summation order for every row count).
at::Tensor gemm_vnni(at::Tensor x, at::Tensor packed) {
  check_packed("gemm_vnni", x, packed);
  return run_tiles(x, packed);
}

// Rows `ids` of the weight held as VNNI tiles [N/16, K/32, 16, 32] -> [T, K]: an embedding
// lookup with no row-major copy kept. One call instead of layouts.bf16_tile_rows' five torch
// ops (a batch-1 decode step's embedding took ~1% of the step through them); the same bits.
at::Tensor bf16_tile_rows(const at::Tensor& tiles, const at::Tensor& ids) {
  TORCH_CHECK(tiles.scalar_type() == at::kBFloat16 && tiles.dim() == 4 && tiles.size(2) == kWeightTileK / 2 &&
                  tiles.size(3) == 2 * kWeightTileRows && tiles.is_contiguous(),
              "bf16_tile_rows: tiles must come from amx_pack_weight");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "bf16_tile_rows: ids must be int64 [T]");
  const at::Tensor idc = ids.contiguous();
  const int64_t T = idc.size(0), G = tiles.size(0), KB = tiles.size(1), N = G * kWeightTileRows;
  const int64_t K = KB * kWeightTileK;
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < N, "bf16_tile_rows: row ", id[t], " outside the weight's ", N, " rows");
  at::Tensor out = at::empty({T, K}, tiles.options());
  // a tile row kp holds each of the 16 rows' pair (k = 32kb + 2kp, k + 1): one 4-byte word per pair
  const uint32_t* src = reinterpret_cast<const uint32_t*>(tiles.data_ptr<at::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<at::BFloat16>());
  constexpr int64_t kPairs = kWeightTileK / 2;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t g = id[t] / kWeightTileRows, r = id[t] % kWeightTileRows;
    const uint32_t* row = src + g * KB * kPairs * kWeightTileRows + r;
    uint32_t* o = dst + t * (K / 2);
    for (int64_t p = 0; p < KB * kPairs; ++p) o[p] = row[p * kWeightTileRows];
  }
  return out;
}

// w [N, K] bf16 → VNNI tiles [N/16, K/32, 16, 32]: tile (nb, kb) row kp holds, for each of the
// 16 columns n, the pair (w[16nb + n][32kb + 2kp], w[16nb + n][32kb + 2kp + 1])
at::Tensor amx_pack_weight(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "amx_pack_weight: [N, K] bf16");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kWeightTileRows == 0 && K % kWeightTileK == 0, "amx_pack_weight: N % ", kWeightTileRows,
              " == 0 and K % ", kWeightTileK, " == 0, got ", N, "x", K);
  return w.contiguous()
      .view({N / kWeightTileRows, kWeightTileRows, K / kWeightTileK, kWeightTileK / 2, 2})
      .permute({0, 2, 3, 1, 4})
      .contiguous()
      .view({N / kWeightTileRows, K / kWeightTileK, kWeightTileK / 2, kWeightTileK});
}
