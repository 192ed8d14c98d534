// A dumb runner for the torch-free kernel core (kvserve/kernels/core), so that the core can be
// tested at levels this machine cannot execute natively (the aarch64 levels, under qemu):
// tests/kernels/test_core_emulated.py writes the cases, runs this binary and checks its outputs.
// Compiled as one translation unit with every core source included below, at one level's flags
// and -DKVSERVE_LEVEL_NS=<level>.
//
//   core_driver CASE_DIR OUT_DIR
//
// CASE_DIR/manifest.txt holds one case a line: `ID FAMILY key=value ...`, values integers or
// floats (C99 hex floats: exact), plus `in=NAME@FILE,...` and `out=NAME@FILE,...`: each array
// is the raw little-endian file CASE_DIR/FILE.bin (named by its contents' hash, so cases
// sharing a pool share its file). The outputs come with their initial contents too (so this
// driver never computes a shape, and pools updated in place start as Python made them) and
// are written to OUT_DIR/ID.NAME.bin after the call. An array a family takes as optional
// (bias, mins, scales, start positions, lse, residual) is null when not named.
// "ok ID" is printed after each case, so a crash names the case it happened in.
#include "../../../kvserve/kernels/core/argmax_core.cpp"
#include "../../../kvserve/kernels/core/decode_attention_core.cpp"
#include "../../../kvserve/kernels/core/gemv_core.cpp"
#include "../../../kvserve/kernels/core/moe_route_core.cpp"
#include "../../../kvserve/kernels/core/norm_rope_act_core.cpp"
#include "../../../kvserve/kernels/core/prefill_attention_core.cpp"
#include "../../../kvserve/kernels/core/quant_linear_core.cpp"
#include "../../../kvserve/kernels/core/shared_prefix_attention_core.cpp"

#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace core = kvserve::KVSERVE_LEVEL_NS;

namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// A case's arrays (64-byte aligned, as the torch layer's allocations are) and parameters
struct Case {
  std::string id, family;
  std::map<std::string, std::string> params;
  std::map<std::string, std::unique_ptr<char, FreeDeleter>> arrays;
  std::map<std::string, size_t> sizes;
  std::vector<std::string> outs;

  const std::string& param(const std::string& k) const {
    auto it = params.find(k);
    if (it == params.end()) throw std::runtime_error("case " + id + ": no parameter " + k);
    return it->second;
  }
  int64_t i(const std::string& k) const { return std::stoll(param(k)); }
  float f(const std::string& k) const { return static_cast<float>(std::strtod(param(k).c_str(), nullptr)); }
  bool b(const std::string& k) const { return i(k) != 0; }
  float f_or(const std::string& k, float fallback) const { return params.count(k) ? f(k) : fallback; }
  template <typename T>
  T* opt(const std::string& name) const {  // null when the case names no such array
    auto it = arrays.find(name);
    return it == arrays.end() ? nullptr : reinterpret_cast<T*>(it->second.get());
  }
  template <typename T>
  T* at(const std::string& name) const {
    T* p = opt<T>(name);
    if (!p) throw std::runtime_error("case " + id + ": no array " + name);
    return p;
  }
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string part; std::getline(ss, part, sep);)
    if (!part.empty()) out.push_back(part);
  return out;
}

void load(Case& c, const std::string& dir, const std::string& name, const std::string& file) {
  const std::string path = dir + "/" + file + ".bin";
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error("cannot read " + path);
  const size_t n = static_cast<size_t>(f.tellg());
  char* p = static_cast<char*>(std::aligned_alloc(64, (n + 64) / 64 * 64));
  f.seekg(0);
  f.read(p, static_cast<std::streamsize>(n));
  c.arrays[name].reset(p);
  c.sizes[name] = n;
}

// the quantized weight's segments: seg<i>.{codes,scales,mins,sub} and fmt<i>, groups<i>, per_channel<i>
std::vector<core::quant::SegmentView> segments(const Case& c) {
  std::vector<core::quant::SegmentView> segs;
  for (int64_t s = 0; s < c.i("nsegs"); ++s) {
    const std::string n = std::to_string(s);
    segs.push_back({c.at<uint8_t>("codes" + n), c.at<uint16_t>("scales" + n), c.opt<uint16_t>("mins" + n),
                    c.opt<uint8_t>("sub" + n), c.i("groups" + n), c.b("per_channel" + n), static_cast<int>(c.i("fmt" + n))});
  }
  return segs;
}

template <typename E>
core::nra::RopeArgs<E> rope_args(const Case& c) {
  return {c.at<E>("qkv"), c.i("width"), c.at<int64_t>("positions"), c.at<float>("cos"), c.at<float>("sin"),
          c.at<int64_t>("slots"), c.i("T"), c.i("num_heads"), c.i("num_kv_heads"), c.i("head_dim"), c.at<E>("q_out")};
}

void run(const Case& c) {
  const std::string& f = c.family;
  if (f == "gemv_rowmajor" || f == "gemm_tiles") {
    if (f == "gemv_rowmajor")
      core::gemv::gemv_rowmajor(c.at<uint16_t>("x"), c.at<uint16_t>("w"), c.at<uint16_t>("y"), c.i("M"), c.i("K"), c.i("N"));
    else  // the level's own compute format (the ARM levels have no bf16 pair dots)
      core::gemv::gemm_tiles(c.at<uint16_t>("x"), c.at<uint16_t>("w"), c.at<uint16_t>("y"), c.i("M"), c.i("K"), c.i("N"));
  } else if (f == "quant_linear") {
    const auto segs = segments(c);
    const int64_t M = c.i("M"), K = c.i("K");
    // scratch as the torch layer sizes it; 64-byte aligned as the core requires
    const size_t bytes = core::quant::quant_linear_scratch_bytes(M, K);
    std::unique_ptr<char, FreeDeleter> scratch(static_cast<char*>(std::aligned_alloc(64, (bytes + 64) / 64 * 64)));
    core::quant::quant_linear(c.at<void>("x"), c.b("x_bf16"), M, K, segs.data(), static_cast<int64_t>(segs.size()),
                              c.opt<uint16_t>("bias"), c.at<void>("y"), c.b("y_bf16"), scratch.get());
  } else if (f == "quant_linear_rows") {
    const auto segs = segments(c);
    const int64_t R = c.i("R"), K = c.i("K");
    const size_t bytes = core::quant::quant_linear_scratch_bytes(R, K);
    std::unique_ptr<char, FreeDeleter> scratch(static_cast<char*>(std::aligned_alloc(64, (bytes + 64) / 64 * 64)));
    core::quant::quant_linear_rows(c.at<void>("x"), c.b("x_bf16"), R, K, segs.data(), c.at<int64_t>("first"),
                                   c.at<void>("y"), c.b("y_bf16"), scratch.get());
  } else if (f == "quant_embedding") {
    const auto segs = segments(c);
    core::quant::quant_embedding(c.at<int64_t>("ids"), c.i("T"), segs.data(), static_cast<int64_t>(segs.size()), c.i("K"),
                                 c.at<float>("out"));
  } else if (f == "decode_attention") {
    namespace da = core::decode_attention;
    da::Args a;
    a.q = c.at<void>("q");
    a.q_bf16 = c.b("q_bf16");
    a.pool = static_cast<da::PoolType>(c.i("pool"));  // 0 bf16, 1 fp32, 2 int8
    a.k_pool = c.at<void>("k_pool");
    a.v_pool = c.at<void>("v_pool");
    a.k_scale = c.opt<float>("k_scale");
    a.v_scale = c.opt<float>("v_scale");
    a.block_tables = c.at<int32_t>("block_tables");
    a.context_lens = c.at<int32_t>("context_lens");
    a.start_positions = c.opt<int32_t>("start_positions");
    a.B = c.i("B");
    a.num_heads = c.i("num_heads");
    a.num_kv_heads = c.i("num_kv_heads");
    a.head_dim = c.i("head_dim");
    a.block_size = c.i("block_size");
    a.max_blocks = c.i("max_blocks");
    a.scale = c.f("scale");
    a.softcap = c.f_or("softcap", 0.f);
    a.out = c.at<void>("out");
    a.out_bf16 = c.b("out_bf16");
    a.lse = c.opt<float>("lse");
    da::paged_decode_attention(a);
  } else if (f == "prefill_attention") {
    core::PrefillAttentionArgs a;
    a.q = c.at<uint16_t>("q");
    a.out = c.at<uint16_t>("out");
    a.k_pool = c.at<void>("k_pool");
    a.v_pool = c.at<void>("v_pool");
    a.k_scale = c.opt<float>("k_scale");
    a.v_scale = c.opt<float>("v_scale");
    a.int8 = a.k_scale != nullptr;
    a.num_heads = c.i("num_heads");
    a.num_kv_heads = c.i("num_kv_heads");
    a.head_dim = c.i("head_dim");
    a.slots = c.at<int64_t>("slots");
    a.segments = c.at<int64_t>("segments");
    a.num_segments = c.i("num_segments");
    a.leader = c.opt<int64_t>("leader");
    a.shared_len = c.opt<int64_t>("shared_len");
    a.scale = c.f("scale");
    a.softcap = c.f_or("softcap", 0.f);
    core::paged_prefill_attention(a);
  } else if (f == "shared_prefix_attention") {
    core::shared_prefix::Args a;
    a.q = c.at<uint16_t>("q");
    a.k_pool = c.at<void>("k_pool");
    a.v_pool = c.at<void>("v_pool");
    a.k_scale = c.opt<float>("k_scale");
    a.v_scale = c.opt<float>("v_scale");
    a.int8 = a.k_scale != nullptr;
    a.blocks = c.at<int32_t>("blocks");
    a.prefix_len = c.i("prefix_len");
    a.n = c.i("n");
    a.num_heads = c.i("num_heads");
    a.num_kv_heads = c.i("num_kv_heads");
    a.head_dim = c.i("head_dim");
    a.block_size = c.i("block_size");
    a.scale = c.f("scale");
    a.softcap = c.f_or("softcap", 0.f);
    a.out = c.at<float>("out");
    a.lse = c.at<float>("lse");
    core::shared_prefix::shared_prefix_attention(a);
  } else if (f == "merge_attention_states") {
    core::shared_prefix::merge_attention_states(c.at<float>("xa"), c.at<float>("la"), c.at<float>("xb"), c.at<float>("lb"),
                                                c.i("rows"), c.i("H"), c.opt<float>("out_f32"), c.opt<uint16_t>("out_bf16"),
                                                c.at<float>("lse"));
  } else if (f == "rms_norm") {
    if (c.b("bf16"))
      core::nra::rms_norm(c.at<uint16_t>("x"), c.at<uint16_t>("w"), c.at<uint16_t>("out"), c.opt<uint16_t>("residual"),
                          c.i("T"), c.i("D"), c.f("eps"));
    else
      core::nra::rms_norm(c.at<float>("x"), c.at<float>("w"), c.at<float>("out"), c.opt<float>("residual"), c.i("T"),
                          c.i("D"), c.f("eps"));
  } else if (f == "rope_and_cache") {
    if (c.b("bf16")) core::nra::rope_and_cache(rope_args<uint16_t>(c), c.at<uint16_t>("k_pool"), c.at<uint16_t>("v_pool"));
    else core::nra::rope_and_cache(rope_args<float>(c), c.at<float>("k_pool"), c.at<float>("v_pool"));
  } else if (f == "rope_and_cache_int8") {
    int8_t *k = c.at<int8_t>("k_pool"), *v = c.at<int8_t>("v_pool");
    float *ks = c.at<float>("k_scale"), *vs = c.at<float>("v_scale");
    if (c.b("bf16")) core::nra::rope_and_cache_int8(rope_args<uint16_t>(c), k, v, ks, vs);
    else core::nra::rope_and_cache_int8(rope_args<float>(c), k, v, ks, vs);
  } else if (f == "silu_and_mul" || f == "gelu_tanh_and_mul") {
    const bool silu = f == "silu_and_mul";
    if (c.b("bf16")) {
      auto fn = silu ? static_cast<void (*)(const uint16_t*, uint16_t*, int64_t, int64_t)>(core::nra::silu_and_mul)
                     : static_cast<void (*)(const uint16_t*, uint16_t*, int64_t, int64_t)>(core::nra::gelu_tanh_and_mul);
      fn(c.at<uint16_t>("gate_up"), c.at<uint16_t>("out"), c.i("T"), c.i("F"));
    } else {
      auto fn = silu ? static_cast<void (*)(const float*, float*, int64_t, int64_t)>(core::nra::silu_and_mul)
                     : static_cast<void (*)(const float*, float*, int64_t, int64_t)>(core::nra::gelu_tanh_and_mul);
      fn(c.at<float>("gate_up"), c.at<float>("out"), c.i("T"), c.i("F"));
    }
  } else if (f == "whole_projection_norm") {
    const int64_t T = c.i("T"), q = c.i("q_size"), kv = c.i("kv_size");
    auto call = [&](auto* tag) {
      using E = std::remove_pointer_t<decltype(tag)>;
      core::nra::qk_sum_squares(c.at<E>("qkv"), c.at<float>("sums_out"), T, q, kv);
      core::nra::WholeNormArgs<E> a{c.at<E>("qkv"), c.opt<float>("sums"), c.at<E>("q_w"), c.at<E>("k_w"),
                                    c.at<E>("out"), T, q, kv, c.f("q_width"), c.f("k_width"), c.f("eps")};
      core::nra::whole_projection_norm(a);
    };
    if (c.b("bf16")) call(static_cast<uint16_t*>(nullptr));
    else call(static_cast<float*>(nullptr));
  } else if (f == "moe_route") {
    const int64_t T = c.i("T"), D = c.i("D"), E = c.i("E"), k = c.i("k");
    if (c.b("bf16"))
      core::route::route(c.at<uint16_t>("x"), c.at<float>("router"), T, D, E, k, c.b("renormalise"), c.at<float>("weights"),
                         c.at<int64_t>("experts"));
    else
      core::route::route(c.at<float>("x"), c.at<float>("router"), T, D, E, k, c.b("renormalise"), c.at<float>("weights"),
                         c.at<int64_t>("experts"));
  } else if (f == "argmax_rows") {
    if (c.b("bf16")) core::argmax::argmax_rows(c.at<uint16_t>("x"), c.at<int64_t>("out"), c.i("R"), c.i("V"));
    else core::argmax::argmax_rows(c.at<float>("x"), c.at<int64_t>("out"), c.i("R"), c.i("V"));
  } else {
    throw std::runtime_error("case " + c.id + ": unknown family " + f);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s CASE_DIR OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1], out_dir = argv[2];
  omp_set_num_threads(2);  // the threaded paths (work splits, stealing) with a second thread
  std::ifstream manifest(dir + "/manifest.txt");
  if (!manifest) {
    std::fprintf(stderr, "no %s/manifest.txt\n", dir.c_str());
    return 2;
  }
  int64_t done = 0;
  try {
    for (std::string line; std::getline(manifest, line);) {
      const std::vector<std::string> words = split(line, ' ');
      if (words.size() < 2) continue;
      Case c;
      c.id = words[0];
      c.family = words[1];
      for (size_t w = 2; w < words.size(); ++w) {
        const size_t eq = words[w].find('=');
        const std::string k = words[w].substr(0, eq), v = words[w].substr(eq + 1);
        if (k == "in" || k == "out") {
          for (const std::string& named : split(v, ',')) {
            const size_t at = named.find('@');
            load(c, dir, named.substr(0, at), named.substr(at + 1));
            if (k == "out") c.outs.push_back(named.substr(0, at));
          }
        } else {
          c.params[k] = v;
        }
      }
      run(c);
      for (const std::string& n : c.outs) {
        const std::string path = out_dir + "/" + c.id + "." + n + ".bin";
        std::ofstream o(path, std::ios::binary);
        o.write(c.arrays.at(n).get(), static_cast<std::streamsize>(c.sizes.at(n)));
        if (!o) throw std::runtime_error("cannot write " + path);
      }
      std::printf("ok %s\n", c.id.c_str());
      std::fflush(stdout);
      ++done;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::printf("done %lld\n", static_cast<long long>(done));
  return 0;
}
