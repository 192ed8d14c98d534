// Everything a level's build exports, declared once: to the torch glue every build shares
// (bindings.cpp binds it all, linear.cpp dispatches a Projection, fused_decode.cpp runs a
// decode step's layers, shared_prefix_decode.cpp a decode batch's shared-prefix plan,
// checks.cpp holds shared argument checks) and to the family sources, which implement it:
// ops/<family>.cpp over the torch-free core/, one source per family at every level (the
// amx build adds ops/amx/ over core/amx/). Families:
//
//   gemv                     gemv_bf16, gemv_vnni, gemm_vnni, amx_pack_weight: bf16 projections
//   amx_linear               amx_available, amx_linear(_silu_mul, _argmax) (AMX tiles; refusals elsewhere)
//   decode_attention         paged_decode_attention (_lse: a range of positions, fp32 out + lse)
//   shared_prefix_attention  shared_prefix_attention, merge_attention_states: read-once shared-prefix decode attention
//   prefill_attention        paged_prefill_attention
//   norm_rope_act            rms_norm, qk_sum_squares, whole_projection_norm, rope_and_cache (rope_and_cache_int8),
//                            silu_and_mul, gelu_tanh_and_mul
//   moe_route                moe_route: a sparse layer's router (fp32 logits, softmax, top k)
//   argmax                   argmax_rows
//   quant_linear             quant_linear, quant_embedding: block-quantized weights (int8 dot products)
//
// Each kernel streams or tiles with vectors of a fixed shape, so each refuses shapes off
// its grid with a TORCH_CHECK. Those limits are named here, used by the checks, and exported
// to Python as limits(), a dict with these keys, so that kvserve decides once per model which
// kernels it may use and a model outside them takes the plain-torch path instead of meeting
// a RuntimeError in the middle of a step:
//   gemv_max_rows                             most rows of x gemv_bf16 / gemv_vnni take (1..this)
//   decode_attention_max_queries_per_kv_head  num_heads / num_kv_heads paged_decode_attention takes
//   decode_attention_max_head_dim             longest head paged_decode_attention takes
//   decode_attention_head_dim_multiple_bf16   its head_dim must be a multiple of this with bf16 (or int8) pools
//   decode_attention_head_dim_multiple_fp32   ... and of this with fp32 pools
//   prefill_attention_head_dim_multiple       paged_prefill_attention's head_dim must be a multiple of this
//   rope_head_dim_multiple                    rope_and_cache's head_dim must be a multiple of this
//   rms_norm_width_multiple                   rms_norm's width D must be a multiple of this
//   silu_width_multiple                       silu_and_mul's output width F (input 2F) must be a multiple of this
//   tile_rows                                 amx_pack_weight's N (weight rows, output features) must be a
//                                             multiple of this: gemv_vnni's and the AMX kernels' weights; and
//                                             the intermediate size F for the gate/up interleave of
//                                             amx_linear_silu_mul (its 16-row blocks)
//   tile_k                                    amx_pack_weight's K (input features) must be a multiple of this
//   amx_argmax_max_rows                       most rows amx_linear_argmax takes (its decode-sized loop)
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

// ---- limits -------------------------------------------------------------------------------

inline constexpr int64_t kGemvMaxRows = 8;  // the row count is a template argument (with_rows)
inline constexpr int64_t kDecodeAttentionMaxQueriesPerKvHead = 16;  // the 16-row A tile of probabilities
inline constexpr int64_t kDecodeAttentionMaxHeadDim = 256;  // the per-head buffers of the core (Gemma 3: 256)
inline constexpr int64_t kDecodeAttentionHeadDimMultipleBf16 = 32;  // dpbf16 pairs: 32 bf16 per chunk
inline constexpr int64_t kDecodeAttentionHeadDimMultipleFp32 = 16;  // one __m512 per 16 features
inline constexpr int64_t kPrefillAttentionHeadDimMultiple = 32;
inline constexpr int64_t kRopeHeadDimMultiple = 32;  // each half of the head in vectors of 16
inline constexpr int64_t kRmsNormWidthMultiple = 16;
inline constexpr int64_t kSiluWidthMultiple = 16;
inline constexpr int64_t kWeightTileRows = 16;  // output columns per VNNI tile block
inline constexpr int64_t kWeightTileK = 32;     // bf16 input features per tile
inline constexpr int64_t kAmxArgmaxMaxRows = 128;

// The profiler range each decode attention call (plain or in parts) records, also from inside
// the fused decode step; kvserve/bench/throughput.py sums it (--profile-attention).
inline constexpr const char* kDecodeAttentionRange = "kvserve::decode_attention";

struct KernelLimit {
  const char* key;
  int64_t value;
};
// limits() in Python: the keys listed above, in that order
inline constexpr KernelLimit kKernelLimits[] = {
    {"gemv_max_rows", kGemvMaxRows},
    {"decode_attention_max_queries_per_kv_head", kDecodeAttentionMaxQueriesPerKvHead},
    {"decode_attention_max_head_dim", kDecodeAttentionMaxHeadDim},
    {"decode_attention_head_dim_multiple_bf16", kDecodeAttentionHeadDimMultipleBf16},
    {"decode_attention_head_dim_multiple_fp32", kDecodeAttentionHeadDimMultipleFp32},
    {"prefill_attention_head_dim_multiple", kPrefillAttentionHeadDimMultiple},
    {"rope_head_dim_multiple", kRopeHeadDimMultiple},
    {"rms_norm_width_multiple", kRmsNormWidthMultiple},
    {"silu_width_multiple", kSiluWidthMultiple},
    {"tile_rows", kWeightTileRows},
    {"tile_k", kWeightTileK},
    {"amx_argmax_max_rows", kAmxArgmaxMaxRows},
};

// ---- levels -------------------------------------------------------------------------------

// Each level's build (kvserve/kernels/build.py) is compiled with -DKVSERVE_LEVEL_NAME="<level>"
// and implements every function below, some as refusals where the level lacks the family
// (only the amx build has AMX). The source file of each family that does run registers it
// with KVSERVE_KERNEL_FAMILY(name); families() in Python lists them with their level, and
// kvserve/kernels/support.py turns off the kernels of a family that is not registered.
#ifndef KVSERVE_LEVEL_NAME
#error "compile the kernels with -DKVSERVE_LEVEL_NAME=\"<level>\" (kvserve/kernels/build.py does)"
#endif
struct FamilyRegistration {
  FamilyRegistration(const char* family, const char* level);
};
#define KVSERVE_FAMILY_CAT2(a, b) a##b
#define KVSERVE_FAMILY_CAT(a, b) KVSERVE_FAMILY_CAT2(a, b)
// __COUNTER__, not __LINE__: a build compiles several sources as one unit (build.py)
#define KVSERVE_KERNEL_FAMILY(name) \
  static const FamilyRegistration KVSERVE_FAMILY_CAT(kvserve_family_, __COUNTER__)(name, KVSERVE_LEVEL_NAME)
// (family, level) of every registered family, in registration order
std::vector<std::pair<std::string, std::string>> kernel_families();

// ---- gemv.cpp -----------------------------------------------------------------------------

// y[M, N] = x[M, K] · w[N, K]ᵀ, 1 <= M <= kGemvMaxRows, bf16, w row-major
at::Tensor gemv_bf16(at::Tensor x, at::Tensor w);
// the same on amx_pack_weight(w) (CPUs without AMX)
at::Tensor gemv_vnni(at::Tensor x, at::Tensor packed);
// any M on amx_pack_weight(w): tiles of 8 rows of gemv_vnni's kernel (the tile copy then serves every row count)
at::Tensor gemm_vnni(at::Tensor x, at::Tensor packed);

// ---- amx_linear.cpp -----------------------------------------------------------------------

// True when this CPU has AMX-BF16 and Linux let this process use the tile registers.
bool amx_available();
// The bf16 GEMM's compute format on the VNNI tiles at the levels with bf16 pair dots
// (avx512-bf16, amx): VDPBF16PS pair dots (on) or weights widened to fp32 FMAs (off), the same
// for every call of the process; elsewhere always off. Returns what is now in effect.
bool set_bf16_pair_dots(bool on);
bool bf16_pair_dots();
// w [N, K] bf16 → VNNI tiles [N/16, K/32, 16, 32]
at::Tensor amx_pack_weight(at::Tensor w);
// rows `ids` (int64 [T]) of the weight amx_pack_weight packed -> [T, K] bf16 (an embedding lookup)
at::Tensor bf16_tile_rows(const at::Tensor& tiles, const at::Tensor& ids);
at::Tensor amx_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias);
at::Tensor amx_linear_silu_mul(at::Tensor x, at::Tensor packed);
at::Tensor amx_linear_argmax(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias);

// ---- decode_attention.cpp -----------------------------------------------------------------

// bf16, fp32 or int8 pools; int8 pools (an int8 KV cache) come with their scales
// [num_blocks, block_size, N_kv] fp32 (bf16 or fp32 queries); float pools take none.
// softcap > 0: each score capped to softcap·tanh(score / softcap) before the softmax (Gemma 2's
// attention-logit soft-capping; lse is then over the capped scores); 0: none. The same in every
// attention kernel below.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                  at::Tensor block_tables, at::Tensor context_lens, double scale,
                                  c10::optional<at::Tensor> k_scale = c10::nullopt,
                                  c10::optional<at::Tensor> v_scale = c10::nullopt, double softcap = 0);
// Row b over its positions [start_positions[b], context_lens[b]) only (the suffix after a shared
// prefix; start_positions int32 [B]): (out [B, N_q, H] fp32 normalised, lse [B, N_q] fp32 =
// max + log Σ exp(scale·q·k)); an empty range gives out 0 and lse -inf. bf16, fp32 or int8 pools
// (with their scales, as paged_decode_attention).
std::tuple<at::Tensor, at::Tensor> paged_decode_attention_lse(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                                              at::Tensor block_tables, at::Tensor context_lens,
                                                              at::Tensor start_positions, double scale,
                                                              c10::optional<at::Tensor> k_scale = c10::nullopt,
                                                              c10::optional<at::Tensor> v_scale = c10::nullopt,
                                                              double softcap = 0);

// ---- checks.cpp ---------------------------------------------------------------------------

// The argument checks both family trees run before their kernels (the same messages at every
// level). int8 pools [num_blocks, block_size, N_kv, H] need their contiguous fp32 scales, one
// per (slot, KV head), and contiguous pools; `who` names the kernel in the error.
void check_int8_pools(const at::Tensor& k_pool, const at::Tensor& v_pool, const c10::optional<at::Tensor>& k_scale,
                      const c10::optional<at::Tensor>& v_scale, const char* who);
// shared_prefix_attention's arguments, its prefix blocks inside the pool included
void check_shared_prefix_args(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                              const at::Tensor& prefix_blocks, int64_t prefix_len, const c10::optional<at::Tensor>& k_scale,
                              const c10::optional<at::Tensor>& v_scale);
// paged_prefill_attention's arguments (not the segments' ranges, which each tree reads as it goes)
void check_prefill_args(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& slots,
                        const at::Tensor& segments, double scale, const at::Tensor& out,
                        const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale);
// rope_and_cache_int8's pools, scales and index dtypes
void check_rope_and_cache_int8_args(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& slot_mapping,
                                    const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& k_scale,
                                    const at::Tensor& v_scale, int64_t head_dim);

// ---- shared_prefix_attention.cpp ----------------------------------------------------------

// The n query rows q [n, N_q, H] bf16 of a group whose block tables all start with prefix_blocks
// (int32 [P]) against those blocks' first prefix_len positions (<= P·block_size), non-causal, each
// K/V row read once for the whole group: (out [n, N_q, H] fp32 normalised, lse [n, N_q] fp32 =
// max + log Σ exp(scale·q·k)); prefix_len 0 gives out 0, lse -inf. bf16 or int8 pools (with their scales). A
// row's result does not depend on the other rows of the group (bitwise).
std::tuple<at::Tensor, at::Tensor> shared_prefix_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                                           at::Tensor prefix_blocks, int64_t prefix_len, double scale,
                                                           c10::optional<at::Tensor> k_scale = c10::nullopt,
                                                           c10::optional<at::Tensor> v_scale = c10::nullopt,
                                                           double softcap = 0);
// Two attention parts of the same rows merged through their log-sum-exp, in fp32: out_* [..., H]
// fp32, lse_* [...] fp32 (-inf: an empty part, no weight; both empty give 0). Returns (out in
// out_dtype (fp32 or bf16), merged lse fp32), so merges chain (groups within groups).
std::tuple<at::Tensor, at::Tensor> merge_attention_states(at::Tensor out_a, at::Tensor lse_a, at::Tensor out_b,
                                                          at::Tensor lse_b, at::ScalarType out_dtype);
// The per-row math of merge_attention_states, for callers that merge in place: (xa, la) and
// (xb, lb) -> dst (fp32 or bf16, may be xa) and *lse_out. H a multiple of 16.
void merge_attention_row(const float* xa, float la, const float* xb, float lb, int64_t H, float* dst_f32,
                         at::BFloat16* dst_bf16, float* lse_out);

// ---- shared_prefix_decode.cpp ----------------------------------------------------------------

// One shared level of a decode batch's plan (kvserve/attention/shared_prefix_plan.py SharedLevel): its
// member rows (int64 [n], ascending) attend to the first num_positions positions of `blocks`
// (int32 [P], the same at the same table indices in every member's table).
struct SharedPrefixLevel {
  at::Tensor members;
  at::Tensor blocks;
  int64_t num_positions;
};
// A decode step's plan, shared by all layers: each row's suffix starts at suffix_start (int32
// [B]); levels outer first (a level's rows merge it after the levels above it).
struct SharedPrefixDecodePlan {
  at::Tensor suffix_start;
  std::vector<SharedPrefixLevel> levels;
};
// Decode attention of q [B, N_q, H] bf16 in parts: each row's suffix
// (paged_decode_attention_lse), then every level (shared_prefix_attention, each block read once
// for its members), merged into the rows in place in fp32, in that order. Returns [B, N_q, H] bf16.
at::Tensor shared_prefix_decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor block_tables,
                                    at::Tensor context_lens, const SharedPrefixDecodePlan& plan, double scale,
                                    c10::optional<at::Tensor> k_scale = c10::nullopt,
                                    c10::optional<at::Tensor> v_scale = c10::nullopt, double softcap = 0);

// ---- prefill_attention.cpp ----------------------------------------------------------------

// bf16 queries over bf16 pools, or int8 pools with their scales (as paged_decode_attention);
// `shared` int64 [n, 2] (leader, shared_len): segments over a shared cached prefix read its
// packed K/V from their leader (the pool read once for the group; the same bits).
void paged_prefill_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slots,
                             at::Tensor segments, double scale, at::Tensor out,
                             c10::optional<at::Tensor> k_scale = c10::nullopt,
                             c10::optional<at::Tensor> v_scale = c10::nullopt,
                             c10::optional<at::Tensor> shared = c10::nullopt, double softcap = 0);

// ---- norm_rope_act.cpp --------------------------------------------------------------------

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps, c10::optional<at::Tensor> residual);
at::Tensor rope_and_cache(at::Tensor qkv, at::Tensor positions, at::Tensor cos_table, at::Tensor sin_table,
                          at::Tensor k_pool, at::Tensor v_pool, at::Tensor slot_mapping,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
// The same RoPE, K and V quantized into int8 pools, one fp32 scale per (slot, KV head) into
// k_scale / v_scale (the rule of kvserve/attention/kv_pool.py quantize_kv).
at::Tensor rope_and_cache_int8(at::Tensor qkv, at::Tensor positions, at::Tensor cos_table, at::Tensor sin_table,
                               at::Tensor k_pool, at::Tensor v_pool, at::Tensor k_scale, at::Tensor v_scale,
                               at::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
at::Tensor silu_and_mul(at::Tensor gate_up);
at::Tensor gelu_tanh_and_mul(at::Tensor gate_up);  // Gemma's GeGLU: gelu_tanh(gate) · up
// OLMoE's q/k norms over the whole Q and K projections of qkv [T, q_size + 2·kv_size]: each row's
// (Σ q², Σ k²) fp32 [T, 2]; and the normalised rows (V as it is) from those sums, or the row's own
at::Tensor qk_sum_squares(at::Tensor qkv, int64_t q_size, int64_t kv_size);
at::Tensor whole_projection_norm(at::Tensor qkv, at::Tensor q_weight, at::Tensor k_weight, int64_t q_size,
                                 int64_t kv_size, double q_width, double k_width, double eps,
                                 c10::optional<at::Tensor> sums);

// ---- moe_route.cpp ------------------------------------------------------------------------

// Each token's router choice (model/moe.py route): softmax of its fp32 logits over all experts,
// the top k, renormalised where norm_topk_prob: (weights fp32 [T, k], experts int64 [T, k],
// the largest first)
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& router, int64_t top_k,
                                             bool norm_topk_prob);

// ---- argmax.cpp ---------------------------------------------------------------------------

at::Tensor argmax_rows(at::Tensor x);

// ---- quant_linear.cpp ---------------------------------------------------------------------

// Weight formats of a QuantSegment (kvserve/kernels/layouts.py packs them); a weight is
// w = d·c + m per block of 32 inputs of one output column, c its unsigned code:
inline constexpr int64_t kQuantQ8 = 0;     // 8-bit codes q+128, m = -128·d       (Q8_0, int8 of float weights)
inline constexpr int64_t kQuantQ4 = 1;     // 4-bit codes q+8, m = -8·d           (Q4_0)
inline constexpr int64_t kQuantQ4Min = 2;  // 4-bit codes, m stored              (Q4_1, Q4_K, int4 of float weights)
inline constexpr int64_t kQuantQ8Min = 3;  // 8-bit codes, m stored              (Q5_0, Q5_1, Q5_K)
// the K-quants, in GGUF's own scales: d (dmin) per 256 inputs, small integer scales per block in `sub`
inline constexpr int64_t kQuantQ4K = 4;    // 4-bit codes, w = d·sc·c − dmin·mn   (Q4_K)
inline constexpr int64_t kQuantQ6K = 5;    // 6-bit codes q+32, w = d·sc·q, sc per 16 inputs (Q6_K)

// One run of output columns (a multiple of 16) in one format (kvserve/kernels/layouts.py):
//   codes  uint8 [N/16, K/32, 512] (8-bit), [N/16, K/32, 384] (6-bit) or [N/16, K/32, 256] (4-bit)
//   scales fp16 [N/16, K/32, 16], [N/16, 1, 16] for one scale per output column, [N/16, K/256, 16] (K-quants' d)
//   mins   fp16 as scales for the formats that store m (the K-quants' dmin); undefined otherwise
//   sub    the K-quants' block scales uint8 [N/16, K/32, 32]; undefined otherwise
struct QuantSegment {
  at::Tensor codes, scales, mins;
  int64_t format = kQuantQ8;
  at::Tensor sub;
};

// y [M, N] (x's dtype, bf16 or fp32; fp32 if float_out) = x [M, K] · Wᵀ + bias for W the
// segments stacked by rows; x is quantized per row and block of 32 (the int8 compute format). Any M.
at::Tensor quant_linear(const at::Tensor& x, const std::vector<QuantSegment>& w, const c10::optional<at::Tensor>& bias,
                        bool float_out = false);
// y [R, N]: row r = x[r] · W_rᵀ for W_r = per_row[r]'s segments (N outputs each, no bias), in one
// parallel pass; row r's bits are quant_linear(x[r:r+1], per_row[r])'s. A token's routed experts.
at::Tensor quant_linear_rows(const at::Tensor& x, const std::vector<std::vector<QuantSegment>>& per_row,
                             bool float_out = false);
// ---- moe_token.cpp ------------------------------------------------------------------------

// A mixture of experts' routed experts, each as its quantized [gate; up] and down segments
// (built once per layer at load): what moe_token reads.
struct MoeExperts {
  std::vector<std::vector<QuantSegment>> gate_up, down;
  bool float_out = false;  // the downs' results in fp32 (else x's dtype)
};

// One token x [1, d]: its top_k experts (fp32 router [E, d], softmax then top k, renormalised
// where norm_topk_prob), their silu(gate)·up and down, summed in fp32 in expert order weighted
// by the router: (out [1, d] fp32, the experts run [k] in index order). moe.py's one-token path.
std::tuple<at::Tensor, at::Tensor> moe_token(const at::Tensor& x, const at::Tensor& router, const MoeExperts& experts,
                                             int64_t top_k, bool norm_topk_prob);

// Rows `ids` of W dequantized ([T, K] in `dtype`): the embedding lookup of a quantized table.
at::Tensor quant_embedding(const at::Tensor& ids, const std::vector<QuantSegment>& w, int64_t K, at::ScalarType dtype);
int64_t quant_out_features(const std::vector<QuantSegment>& w);

// ---- linear.cpp ---------------------------------------------------------------------------

// One projection y = x·Wᵀ (+ b) as its kernels read it. Filled once per weight by the
// Python linear method (kvserve/model/linear_methods), which decides every field.
struct Projection {
  at::Tensor weight;             // row-major [N, K] bf16; undefined when no kernel reads it
  at::Tensor gemv;               // amx_pack_weight(W) for gemv_vnni; undefined -> gemv_bf16 reads `weight`
  at::Tensor amx;                // AMX tiles for amx_linear (or, when silu_interleaved, the gate/up-interleaved pack for amx_linear_silu_mul)
  at::Tensor onednn;             // oneDNN's blocked layout (torch.ops.mkldnn._reorder_linear_weight)
  at::Tensor bias;               // undefined if none
  int64_t gemv_max_rows = 0;     // 1..gemv_max_rows rows -> GEMV; 0 = no GEMV
  int64_t amx_max_rows = 0;      // (gemv_max_rows, amx_max_rows] rows -> AMX; 0 = no AMX
  bool silu_interleaved = false; // `amx` holds [gate; up] with 16-row blocks interleaved
  bool gemv_all_rows = false;    // `gemv` (VNNI tiles) serves every row count (gemm_vnni past gemv_max_rows)
  std::vector<QuantSegment> quant;  // block-quantized weight: quant_linear serves every row count, the rest is unset
  bool float_out = false;           // quant: fp32 results (the LM head's logits: bf16 would tie near-equal ones)
};

// y = x·Wᵀ + b, dispatched by x.size(0) (x is [rows, K]):
//   quant not empty -> quant_linear(x, quant, bias) for every row count;
//   0 rows -> an empty [0, N] result;
//   rows <= gemv_max_rows -> gemv_vnni(x, gemv) if gemv defined else gemv_bf16(x, weight), then bias added in place to the bf16 result;
//   rows <= amx_max_rows and !silu_interleaved -> amx_linear(x, amx, bias);
//   gemv_all_rows -> gemm_vnni(x, gemv) (+ bias), for every row count past the GEMV's;
//   onednn defined -> the boxed mkldnn::_linear_pointwise(x.contiguous(), onednn, bias, "none", [], "");
//   otherwise at::linear(x, weight, bias).
// A branch whose copy is missing (GEMV rows without gemv or weight, AMX rows without amx,
// the last branch without weight) fails with a message naming the field.
at::Tensor linear(const at::Tensor& x, const Projection& p);
// silu(gate)·up for a [gate; up] projection: amx_linear_silu_mul(x, amx) when silu_interleaved and
// gemv_max_rows < rows <= amx_max_rows, else silu_and_mul(linear(x, p)).
at::Tensor linear_silu_mul(const at::Tensor& x, const Projection& p);

// ---- fused_decode.cpp ---------------------------------------------------------------------

// A sparse layer's FFN in the fused step (a mixture of experts, one token: moe_token), and its
// shared expert where the architecture has one (Qwen2-MoE: sigmoid(x·g)-gated, added last).
struct DecodeMoe {
  at::Tensor router;  // fp32 [E, d]
  MoeExperts experts;  // quantized experts (moe_token), or empty and then:
  std::vector<Projection> expert_gate_up, expert_down;  // each expert's float projections, [gate; up] and down
  int64_t top_k = 0;
  bool norm_topk_prob = false;
  Projection shared_gate_up, shared_down;  // the shared expert's; unset where shared_gate is undefined
  at::Tensor shared_gate;                  // fp32 [1, d]; undefined: no shared expert
  std::vector<int64_t> chosen;  // the experts the last step ran, in index order (the Python side's counts)
};

struct DecodeLayer {
  at::Tensor input_norm, post_attention_norm;  // RMSNorm weights: before attention, before the MLP
  // per-head q/k RMSNorm weights [H] (Qwen3, Gemma 3), or with qk_norm_whole the weights of
  // RMSNorms over the whole Q and whole K projection (OLMoE, in fp32 as model/llama.py
  // WholeProjectionNorm); undefined where the model has none
  at::Tensor q_norm, k_norm;
  bool qk_norm_whole = false;
  Projection qkv, o, gate_up, down;  // gate_up and down unset in a sparse layer (moe)
  std::shared_ptr<DecodeMoe> moe;    // null: a dense MLP
  // Gemma's norms of each branch's output before it joins the residual stream (its
  // post_attention_layernorm and post_feedforward_layernorm); undefined where the model has none
  at::Tensor attn_out_norm, mlp_out_norm;
  bool gelu = false;    // the MLP is gelu_tanh(gate)·up on a plain [gate; up] projection (Gemma), else SiLU's
  bool local = false;   // RoPE from the model's local tables (Gemma 3's sliding-window layers)
  int64_t kv_group = 0;  // the step's slot mapping and block tables this layer's pools are indexed by
};

struct DecodeModel {  // built once per loaded model (and again when the KV pools are rebound)
  std::vector<DecodeLayer> layers;
  std::vector<at::Tensor> k_pools, v_pools;
  at::Tensor cos_half, sin_half;  // RoPE tables [max_pos, H/2] fp32
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
  // int8 pools' scales [num_blocks, block_size, N_kv] fp32, one per layer; empty for float pools
  std::vector<at::Tensor> k_scales, v_scales;
  at::Tensor cos_local, sin_local;  // the local layers' RoPE tables (their own base); undefined where none is local
  double softcap = 0;  // the attention kernels' softcap (Gemma 2's attention-logit soft-capping), 0: none
};

// Every decoder layer of a decode batch in one call (one row where a layer is sparse: moe_token); returns the residual stream after the
// last layer (before the final norm). slot_mappings and block_tables: one per KV group
// (engine/kv_groups.py; a model whose layers are of one kind has one), layer l reading
// entry layers[l].kv_group. shared_prefixes: empty, or one plan per KV group over that group's
// blocks (null where the group has none); a layer of a group with a plan reads the shared
// prefixes once per group of requests (shared_prefix_decode_attention).
// window_starts: empty, or one entry per layer, each row's first visible position (int32 [B],
// max(0, len − W)) where the layer's window is seen past this step, else None; such a layer's
// attention is paged_decode_attention_lse over [start, len), whatever the plan.
at::Tensor decode_layers(const DecodeModel& model, at::Tensor h, at::Tensor positions,
                         const std::vector<at::Tensor>& slot_mappings, const std::vector<at::Tensor>& block_tables,
                         at::Tensor context_lens, const std::vector<const SharedPrefixDecodePlan*>& shared_prefixes = {},
                         const std::vector<c10::optional<at::Tensor>>& window_starts = {});
