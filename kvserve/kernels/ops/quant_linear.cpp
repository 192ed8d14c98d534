// The quant_linear family's torch layer over core/quant_linear_core.cpp
// (the layout, the compute format and the row-invariance argument are described there).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "../core/quant_linear.h"
#include "../kernels.h"

KVSERVE_KERNEL_FAMILY("quant_linear");

namespace {

namespace quant_linear_core = kvserve::KVSERVE_LEVEL_NS::quant;

constexpr int64_t kBlock = quant_linear_core::kBlock;
static_assert(quant_linear_core::kFormatQ8 == kQuantQ8 && quant_linear_core::kFormatQ4 == kQuantQ4 &&
                  quant_linear_core::kFormatQ4Min == kQuantQ4Min && quant_linear_core::kFormatQ8Min == kQuantQ8Min &&
                  quant_linear_core::kFormatQ4K == kQuantQ4K && quant_linear_core::kFormatQ6K == kQuantQ6K,
              "the core's format numbers are kernels.h's");

std::vector<quant_linear_core::SegmentView> check_segments(const std::vector<QuantSegment>& segs, int64_t K, const char* who) {
  TORCH_CHECK(!segs.empty(), who, ": no weight segments");
  std::vector<quant_linear_core::SegmentView> out;
  for (const QuantSegment& s : segs) {
    TORCH_CHECK(s.format >= kQuantQ8 && s.format <= kQuantQ6K, who, ": unknown QuantSegment.format ", s.format);
    const int fmt = static_cast<int>(s.format);
    const int64_t groups = s.codes.size(0), KB = K / kBlock, bits = quant_linear_core::format_bits(fmt);
    const bool k_quant = quant_linear_core::format_is_k_quant(fmt);
    TORCH_CHECK(s.codes.dim() == 3 && s.codes.scalar_type() == at::kByte && s.codes.is_contiguous() &&
                    s.codes.size(1) == KB && s.codes.size(2) == bits * 16 * kBlock / 8,
                who, ": codes must be uint8 [groups, K/32, ", bits * 64, "] for K = ", K);
    // the K-quants' d (and dmin) per super-block of 256 inputs; the others' per block (or per column)
    const int64_t params = k_quant ? K / quant_linear_core::kSuper : KB;
    TORCH_CHECK(!k_quant || K % quant_linear_core::kSuper == 0, who, ": a K-quant weight needs K % 256 == 0, got ", K);
    TORCH_CHECK(s.scales.dim() == 3 && s.scales.scalar_type() == at::kHalf && s.scales.is_contiguous() &&
                    s.scales.size(0) == groups && (s.scales.size(1) == params || (!k_quant && s.scales.size(1) == 1)) &&
                    s.scales.size(2) == 16,
                who, k_quant ? ": scales must be fp16 [groups, K/256, 16]" : ": scales must be fp16 [groups, K/32 or 1, 16]");
    const bool mins = quant_linear_core::format_has_min(fmt);
    if (mins)
      TORCH_CHECK(s.mins.defined() && s.mins.scalar_type() == at::kHalf && s.mins.is_contiguous() &&
                      s.mins.numel() == groups * params * 16,
                  who, ": this format needs mins, fp16 [groups, ", k_quant ? "K/256" : "K/32", ", 16]");
    if (k_quant)
      TORCH_CHECK(s.sub.defined() && s.sub.scalar_type() == at::kByte && s.sub.is_contiguous() &&
                      s.sub.numel() == groups * KB * 32,
                  who, ": a K-quant format needs sub, uint8 [groups, K/32, 32]");
    out.push_back(quant_linear_core::SegmentView{
        s.codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(s.scales.data_ptr<at::Half>()),
        mins ? reinterpret_cast<const uint16_t*>(s.mins.data_ptr<at::Half>()) : nullptr,
        k_quant ? s.sub.data_ptr<uint8_t>() : nullptr, groups, !k_quant && s.scales.size(1) == 1 && KB != 1, fmt});
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
  const std::vector<quant_linear_core::SegmentView> w = check_segments(segs, K, "quant_linear");
  const int64_t N = quant_out_features(segs);
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (M == 0) return y;
  const uint16_t* bp = nullptr;
  at::Tensor b;
  if (bias && bias->defined()) {
    b = bias->to(at::kBFloat16).contiguous();
    TORCH_CHECK(b.numel() == N, "quant_linear: bias has ", b.numel(), " values for ", N, " outputs");
    bp = reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>());
  }
  at::Tensor scratch = at::empty({static_cast<int64_t>(quant_linear_core::quant_linear_scratch_bytes(M, K))}, x.options().dtype(at::kByte));
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  quant_linear_core::quant_linear(x.data_ptr(), x_bf16, M, K, w.data(), static_cast<int64_t>(w.size()), bp, y.data_ptr(),
                     y.scalar_type() == at::kBFloat16, scratch.data_ptr());
  return y;
}

at::Tensor quant_linear_rows(const at::Tensor& x_in, const std::vector<std::vector<QuantSegment>>& per_row, bool float_out) {
  TORCH_CHECK(x_in.dim() == 2, "quant_linear_rows: x must be [rows, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat, "quant_linear_rows: x must be bf16 or fp32");
  const at::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(static_cast<int64_t>(per_row.size()) == R, "quant_linear_rows: ", per_row.size(), " weights for ", R, " rows");
  TORCH_CHECK(K % kBlock == 0, "quant_linear_rows: K = ", K, " is not a multiple of ", kBlock);
  std::vector<quant_linear_core::SegmentView> w;
  std::vector<int64_t> first{0};
  const int64_t N = R ? quant_out_features(per_row[0]) : 0;
  for (const std::vector<QuantSegment>& segs : per_row) {
    TORCH_CHECK(quant_out_features(segs) == N, "quant_linear_rows: every row's weight needs ", N, " outputs, one has ",
                quant_out_features(segs));
    const std::vector<quant_linear_core::SegmentView> views = check_segments(segs, K, "quant_linear_rows");
    w.insert(w.end(), views.begin(), views.end());
    first.push_back(static_cast<int64_t>(w.size()));
  }
  at::Tensor y = at::empty({R, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (R == 0) return y;
  at::Tensor scratch = at::empty({static_cast<int64_t>(quant_linear_core::quant_linear_scratch_bytes(R, K))}, x.options().dtype(at::kByte));
  quant_linear_core::quant_linear_rows(x.data_ptr(), x.scalar_type() == at::kBFloat16, R, K, w.data(), first.data(),
                                       y.data_ptr(), y.scalar_type() == at::kBFloat16, scratch.data_ptr());
  return y;
}

at::Tensor quant_embedding(const at::Tensor& ids_in, const std::vector<QuantSegment>& segs, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(K % kBlock == 0, "quant_embedding: K = ", K, " is not a multiple of ", kBlock);
  const std::vector<quant_linear_core::SegmentView> w = check_segments(segs, K, "quant_embedding");
  const int64_t N = quant_out_features(segs);
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t T = ids.numel();
  at::Tensor out = at::empty({T, K}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "quant_embedding: id ", ip[t], " outside [0, ", N, ")");
  quant_linear_core::quant_embedding(ip, T, w.data(), static_cast<int64_t>(w.size()), K, out.data_ptr<float>());
  return dtype == at::kFloat ? out : out.to(dtype);
}
