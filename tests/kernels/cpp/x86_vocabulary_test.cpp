// Every x86 intrinsic the kernel core uses, run over deterministic pseudo-random inputs (and
// their edge cases: saturation extremes, -128 bytes, NaN, ±0, ±inf, denormals, the INT32 range
// edges, .5 ties, shift counts past the width, every immediate), each output printed in hex,
// one line per check, tagged with the intrinsic's name. Built natively on x86 it prints what
// the real instructions give; built for aarch64 it prints what
// kvserve/kernels/core/neon/x86_vocabulary.h gives, and tests/kernels/test_x86_vocabulary_neon.py
// asks the two outputs to be identical (_mm256_rcp_ps lines: see there).
//
// Values go in and out by memcpy, so no check leans on the loads and stores it is not about.
// Lanes of fp arithmetic results that are NaN print as "nan": the two ISAs choose a NaN's
// sign and payload differently (x86_vocabulary.h's header says how), which the core never reads.
#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include "../../../kvserve/kernels/core/neon/x86_vocabulary.h"
#else
#error "x86_vocabulary_test runs on x86-64 (the reference) or aarch64 (the NEON vocabulary)"
#endif

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>

namespace {

constexpr int kN = 200;  // inputs per check (immediate sweeps: a few per immediate)
long g_lines = 0;

uint64_t g_state = 0x2545f4914f6cdd1dull;
uint32_t rnd() {  // xorshift64
  g_state ^= g_state << 13;
  g_state ^= g_state >> 7;
  g_state ^= g_state << 17;
  return uint32_t(g_state >> 32);
}

template <class T, size_t N>
T pick(const T (&a)[N]) {
  return a[rnd() % N];
}

// 32 bytes of one kind of input
enum Kind { I8, I16, I32, F32 };
struct Buf {
  alignas(32) uint8_t b[32];
};

const uint32_t kSpecialF32[] = {
    0x00000000, 0x80000000, 0x7f800000, 0xff800000,  // ±0, ±inf
    0x7fc00000, 0xffc00000, 0x7fc12345, 0xff812345, 0x7f800001, 0x7fa00000,  // quiet and signalling NaNs
    0x00000001, 0x80000001, 0x007fffff, 0x807fffff, 0x00400000,  // denormals
    0x00800000, 0x80800000, 0x7f7fffff, 0xff7fffff, 0x7e800000, 0x01000000,  // normal extremes
    0x3f000000, 0xbf000000, 0x3fc00000, 0xbfc00000, 0x40200000, 0xc0200000, 0x3effffff,
    0x3f800000, 0xbf800000, 0x4b000001, 0x4a800001,  // 0.5 ties, 0.49999997, 1, 2^23+1, 2^22+0.5
    0x4f000000, 0xcf000000, 0x4effffff, 0xcf000001, 0x4f800000, 0xd0000000,  // 2^31, -2^31, INT32 range edges
};

uint32_t gen_f32_bits() {
  switch (rnd() % 5) {
    case 0: return pick(kSpecialF32);
    case 1: return rnd();  // any bits: huge, tiny, NaN
    case 2: {  // a multiple of 0.5 in [-500, 500]: ties for the roundings
      float f = float(int(rnd() % 2001) - 1000) * 0.5f;
      uint32_t u;
      std::memcpy(&u, &f, 4);
      return u;
    }
    case 3: {  // sign, mantissa and an exponent around the useful range
      uint32_t e = 127 - 30 + rnd() % 60;
      return (rnd() & 0x807fffffu) | e << 23;
    }
    default: {  // an ordinary float in [-4, 4]
      float f = float(int32_t(rnd())) * (4.f / 2147483648.f);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      return u;
    }
  }
}

Buf gen(Kind k) {
  static const uint8_t e8[] = {0x80, 0x7f, 0xff, 0x00, 0x01, 0x81, 0xfe, 0x0f, 0xf0};
  static const uint16_t e16[] = {0x8000, 0x7fff, 0xffff, 0x0000, 0x0001, 0x8001, 0x00ff, 0xff00, 0x0080, 0xff80, 0x4000};
  static const uint32_t e32[] = {0x80000000, 0x7fffffff, 0xffffffff, 0, 1, 0x80000001, 0x00010000, 0xffff8000,
                                 0x00007fff, 0x0000ffff, 0x01000001, 0xff000001, 0x40000000};
  Buf r;
  for (int i = 0; i < 32;) {
    const bool edge = rnd() % 4 == 0;
    if (k == I8) {
      r.b[i] = edge ? pick(e8) : uint8_t(rnd());
      i += 1;
    } else if (k == I16) {
      uint16_t v = edge ? pick(e16) : uint16_t(rnd());
      std::memcpy(r.b + i, &v, 2);
      i += 2;
    } else {
      uint32_t v = k == F32 ? gen_f32_bits() : edge ? pick(e32) : rnd() % 3 == 0 ? rnd() % 2001 - 1000 : rnd();
      std::memcpy(r.b + i, &v, 4);
      i += 4;
    }
  }
  return r;
}

template <class V>
V as(const Buf& b) {
  V v;
  std::memcpy(&v, b.b, sizeof(V));
  return v;
}

bool is_nan(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// one line: the name, the input's index, then the value's 32-bit words (nan-canonical if asked)
template <class V>
void out(const char* name, int i, const V& v, bool canon_nan = false) {
  uint32_t w[sizeof(V) / 4];
  std::memcpy(w, &v, sizeof(V));
  std::printf("%s %d", name, i);
  for (uint32_t x : w) canon_nan&& is_nan(x) ? std::printf(" nan") : std::printf(" %08x", x);
  std::printf("\n");
  ++g_lines;
}
void out_u32(const char* name, int i, uint32_t v) {
  std::printf("%s %d %08x\n", name, i, v);
  ++g_lines;
}
uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

#define NAN_CANON true

// ---- checks with an immediate: a template per immediate, swept over 0..N-1 ----------------

template <template <int> class C, int... I>
void sweep(std::integer_sequence<int, I...>) {
  (C<I>::run(), ...);
}
template <template <int> class C, int N>
void sweep() {
  sweep<C>(std::make_integer_sequence<int, N>{});
}

template <int I>
struct ShufflePs {
  static void run() {
    for (int t = 0; t < 2; ++t) {
      const __m256 a = as<__m256>(gen(F32)), b = as<__m256>(gen(F32));  // in this order (not as arguments)
      out("_mm256_shuffle_ps", I * 2 + t, _mm256_shuffle_ps(a, b, I));
    }
  }
};
template <int I>
struct ShuffleEpi32 {
  static void run() {
    for (int t = 0; t < 2; ++t) out("_mm_shuffle_epi32", I * 2 + t, _mm_shuffle_epi32(as<__m128i>(gen(I32)), I));
  }
};
template <int I>
struct Permute4x64 {
  static void run() {
    for (int t = 0; t < 2; ++t) out("_mm256_permute4x64_epi64", I * 2 + t, _mm256_permute4x64_epi64(as<__m256i>(gen(I32)), I));
  }
};
template <int I>
struct Permute2x128 {
  static void run() {
    for (int t = 0; t < 2; ++t) {
      const __m256i a = as<__m256i>(gen(I32)), b = as<__m256i>(gen(I32));
      out("_mm256_permute2x128_si256", I * 2 + t, _mm256_permute2x128_si256(a, b, I));
    }
  }
};
template <int I>
struct Permute2f128 {
  static void run() {
    for (int t = 0; t < 2; ++t) {
      const __m256 a = as<__m256>(gen(F32)), b = as<__m256>(gen(F32));
      out("_mm256_permute2f128_ps", I * 2 + t, _mm256_permute2f128_ps(a, b, I));
    }
  }
};
template <int I>
struct CmpPs {  // 32 predicates, b often equal to a lane-wise
  static void run() {
    for (int t = 0; t < 40; ++t) {
      Buf a = gen(F32), b = gen(F32);
      for (int l = 0; l < 32; l += 4)
        if (rnd() % 3 == 0) std::memcpy(b.b + l, a.b + l, 4);
      out("_mm256_cmp_ps", I * 40 + t, _mm256_cmp_ps(as<__m256>(a), as<__m256>(b), I));
    }
  }
};
// shift counts 0..N-1 (past the width) and 255
template <int I>
struct Shifts {
  static constexpr int n = I < 34 ? I : 255;
  static void run() {
    for (int t = 0; t < 3; ++t) {
      const __m256i a = as<__m256i>(gen(t ? I16 : I32));
      if (n <= 17 || n == 255) {
        out("_mm256_slli_epi16", I * 3 + t, _mm256_slli_epi16(a, n));
        out("_mm256_srli_epi16", I * 3 + t, _mm256_srli_epi16(a, n));
      }
      out("_mm256_slli_epi32", I * 3 + t, _mm256_slli_epi32(a, n));
      out("_mm256_srli_epi32", I * 3 + t, _mm256_srli_epi32(a, n));
    }
  }
};
template <int I>
struct RoundPs {  // the four directions and the current one, with and without NO_EXC
  static constexpr int mode = (I % 5) | (I >= 5 ? _MM_FROUND_NO_EXC : 0);
  static void run() {
    for (int t = 0; t < kN; ++t) out("_mm256_round_ps", I * kN + t, _mm256_round_ps(as<__m256>(gen(F32)), mode));
  }
};

// ---- the rest ---------------------------------------------------------------------------

void loads_stores() {
  alignas(32) uint8_t src[96];
  for (int t = 0; t < 40; ++t) {
    for (auto& c : src) c = uint8_t(rnd());
    const int fo = int(rnd() % 8) * 4, bo = int(rnd() % 32);  // unaligned offsets: floats, bytes
    const float* f = reinterpret_cast<const float*>(src);
    out("_mm256_load_ps", t, _mm256_load_ps(f + (t % 2) * 8));
    out("_mm256_loadu_ps", t, _mm256_loadu_ps(reinterpret_cast<const float*>(src + fo)));
    out("_mm256_load_si256", t, _mm256_load_si256(reinterpret_cast<const __m256i*>(src + (t % 2) * 32)));
    out("_mm256_loadu_si256", t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + bo)));
    out("_mm_loadu_ps", t, _mm_loadu_ps(reinterpret_cast<const float*>(src + fo)));
    out("_mm_loadu_si128", t, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + bo)));
    out("_mm_loadl_epi64", t, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + bo)));
    out("_mm256_broadcast_ss", t, _mm256_broadcast_ss(reinterpret_cast<const float*>(src + fo)));

    // stores into a patterned buffer, printed whole: nothing outside the target may change
    const Buf v = gen(I8);
    alignas(32) uint8_t dst[96];
    auto store = [&](const char* name, auto&& st) {
      std::memset(dst, 0xa5, sizeof(dst));
      st();
      for (int k = 0; k < 96; k += 32) {
        Buf chunk;
        std::memcpy(chunk.b, dst + k, 32);
        out(name, t * 3 + k / 32, as<__m256i>(chunk));
      }
    };
    float* df = reinterpret_cast<float*>(dst);
    store("_mm256_store_ps", [&] { _mm256_store_ps(df + 8, as<__m256>(v)); });
    store("_mm256_storeu_ps", [&] { _mm256_storeu_ps(reinterpret_cast<float*>(dst + fo + 4), as<__m256>(v)); });
    store("_mm256_store_si256", [&] { _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 32), as<__m256i>(v)); });
    store("_mm256_storeu_si256", [&] { _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + bo + 3), as<__m256i>(v)); });
    store("_mm_storeu_ps", [&] { _mm_storeu_ps(reinterpret_cast<float*>(dst + fo + 4), as<__m128>(v)); });
    store("_mm_store_si128", [&] { _mm_store_si128(reinterpret_cast<__m128i*>(dst + 16), as<__m128i>(v)); });
    store("_mm_storeu_si128", [&] { _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + bo + 5), as<__m128i>(v)); });
    store("_mm_storel_epi64", [&] { _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + bo + 7), as<__m128i>(v)); });
  }
  _mm_prefetch(reinterpret_cast<const char*>(src), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(src + 64), _MM_HINT_T1);
  out_u32("_mm_prefetch", 0, 1);  // it ran
}

void sets_casts() {
  for (int t = 0; t < 40; ++t) {
    const Buf a = gen(F32), w = gen(I32);
    uint32_t u[8];
    std::memcpy(u, w.b, 32);
    float fl;
    std::memcpy(&fl, a.b, 4);
    out("_mm256_set1_ps", t, _mm256_set1_ps(fl));
    out("_mm256_set1_epi8", t, _mm256_set1_epi8(char(u[0])));
    out("_mm256_set1_epi16", t, _mm256_set1_epi16(short(u[1])));
    out("_mm256_set1_epi32", t, _mm256_set1_epi32(int(u[2])));
    out("_mm256_setr_epi32", t,
        _mm256_setr_epi32(int(u[0]), int(u[1]), int(u[2]), int(u[3]), int(u[4]), int(u[5]), int(u[6]), int(u[7])));
    out("_mm256_castps_si256", t, _mm256_castps_si256(as<__m256>(a)));
    out("_mm256_castsi256_ps", t, _mm256_castsi256_ps(as<__m256i>(w)));
    out("_mm256_castps256_ps128", t, _mm256_castps256_ps128(as<__m256>(a)));
    out("_mm256_castsi256_si128", t, _mm256_castsi256_si128(as<__m256i>(w)));
    out("_mm256_extractf128_ps", t * 2, _mm256_extractf128_ps(as<__m256>(a), 0));
    out("_mm256_extractf128_ps", t * 2 + 1, _mm256_extractf128_ps(as<__m256>(a), 1));
    out("_mm256_extracti128_si256", t * 2, _mm256_extracti128_si256(as<__m256i>(w), 0));
    out("_mm256_extracti128_si256", t * 2 + 1, _mm256_extracti128_si256(as<__m256i>(w), 1));
    out_u32("_mm256_cvtss_f32", t, bits(_mm256_cvtss_f32(as<__m256>(a))));
    out_u32("_mm_cvtss_f32", t, bits(_mm_cvtss_f32(as<__m128>(a))));
    out_u32("_mm_cvtsi128_si32", t, uint32_t(_mm_cvtsi128_si32(as<__m128i>(w))));
  }
  out("_mm256_setzero_ps", 0, _mm256_setzero_ps());
  out("_mm256_setzero_si256", 0, _mm256_setzero_si256());
  out_u32("_MM_SHUFFLE", 0, _MM_SHUFFLE(3, 1, 2, 0));
  out_u32("_MM_SHUFFLE", 1, _MM_SHUFFLE(2, 0, 2, 0));
  out_u32("_MM_SHUFFLE", 2, _MM_SHUFFLE(0, 3, 1, 2));
  out_u32("_MM_FROUND_TO_NEAREST_INT", 0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  out_u32("_MM_FROUND_NO_EXC", 0, _MM_FROUND_NO_EXC);
  out_u32("_MM_HINT_T0", 0, _MM_HINT_T0);
  out_u32("_CMP_GT_OQ", 0, _CMP_GT_OQ);
}

void fp_ops() {
  for (int t = 0; t < kN; ++t) {
    const Buf ab = gen(F32);
    Buf bb = gen(F32);
    const Buf cb = gen(F32);
    for (int l = 0; l < 32; l += 4)  // equal lanes: ±0 and NaN ties for max/min
      if (rnd() % 4 == 0) std::memcpy(bb.b + l, ab.b + l, 4);
    float fa[8], fb[8], fc[8];
    std::memcpy(fa, ab.b, 32), std::memcpy(fb, bb.b, 32), std::memcpy(fc, cb.b, 32);
    for (int l = 0; l < 8; ++l) {  // c = ∓a·b rounded: the fused ops' result is the product's rounding error
      const uint32_t r = rnd() % 6;
      if (r < 2) fc[l] = r ? fa[l] * fb[l] : -(fa[l] * fb[l]);
    }
    if (t % 8 == 0)  // small integers: a·b exact, so fmsub(a, b, a·b) is an exact zero (+0 on x86)
      for (int l = 0; l < 8; ++l) {
        fa[l] = float(int(rnd() % 21) - 10), fb[l] = float(int(rnd() % 21) - 10);
        fc[l] = rnd() % 2 ? fa[l] * fb[l] : -(fa[l] * fb[l]);
      }
    __m256 a, b, c;
    std::memcpy(&a, fa, 32), std::memcpy(&b, fb, 32), std::memcpy(&c, fc, 32);
    const __m128 a4 = _mm256_castps256_ps128(a), b4 = _mm256_castps256_ps128(b);

    out("_mm256_add_ps", t, _mm256_add_ps(a, b), NAN_CANON);
    out("_mm256_sub_ps", t, _mm256_sub_ps(a, b), NAN_CANON);
    out("_mm256_mul_ps", t, _mm256_mul_ps(a, b), NAN_CANON);
    out("_mm256_div_ps", t, _mm256_div_ps(a, b), NAN_CANON);
    out("_mm256_hadd_ps", t, _mm256_hadd_ps(a, b), NAN_CANON);
    out("_mm256_fmadd_ps", t, _mm256_fmadd_ps(a, b, c), NAN_CANON);
    out("_mm256_fmsub_ps", t, _mm256_fmsub_ps(a, b, c), NAN_CANON);
    out("_mm256_fnmadd_ps", t, _mm256_fnmadd_ps(a, b, c), NAN_CANON);
    out("_mm256_max_ps", t, _mm256_max_ps(a, b));
    out("_mm256_min_ps", t, _mm256_min_ps(a, b));
    out("_mm256_and_ps", t, _mm256_and_ps(a, b));
    out("_mm256_andnot_ps", t, _mm256_andnot_ps(a, b));
    out("_mm256_blendv_ps", t, _mm256_blendv_ps(a, b, c));
    out("_mm_add_ps", t, _mm_add_ps(a4, b4), NAN_CANON);
    out("_mm_mul_ps", t, _mm_mul_ps(a4, b4), NAN_CANON);
    out("_mm_max_ps", t, _mm_max_ps(a4, b4));
    out("_mm_add_ss", t, _mm_add_ss(a4, b4), NAN_CANON);
    out("_mm_max_ss", t, _mm_max_ss(a4, b4));
    out("_mm_movehl_ps", t, _mm_movehl_ps(a4, b4));
    out("_mm_movehdup_ps", t, _mm_movehdup_ps(a4));
    out("_mm256_cvtps_epi32", t, _mm256_cvtps_epi32(a));
    out("_mm256_cvtepi32_ps", t, _mm256_cvtepi32_ps(as<__m256i>(gen(I32))));
    // the input too: the test checks these lanes against 1/x, not x86's estimate bits
    uint32_t in[8], r[8];
    std::memcpy(in, &a, 32);
    const __m256 rc = _mm256_rcp_ps(a);
    std::memcpy(r, &rc, 32);
    std::printf("_mm256_rcp_ps %d", t);
    for (uint32_t x : in) std::printf(" %08x", x);
    for (uint32_t x : r) std::printf(" %08x", x);
    std::printf("\n");
    ++g_lines;
  }
}

void int_ops() {
  for (int t = 0; t < kN; ++t) {
    const __m256i a8 = as<__m256i>(gen(I8)), b8 = as<__m256i>(gen(I8)), c8 = as<__m256i>(gen(I8));
    const __m256i a16 = as<__m256i>(gen(I16)), b16 = as<__m256i>(gen(I16));
    const __m256i a32 = as<__m256i>(gen(I32)), b32 = as<__m256i>(gen(I32));
    const __m128i a8x = _mm256_castsi256_si128(a8), a16x = _mm256_castsi256_si128(a16);
    const __m128i a32x = _mm256_castsi256_si128(a32), b32x = _mm256_castsi256_si128(b32);
    const __m128i a16y = _mm256_castsi256_si128(b16);
    // small u8 and s8, as the 4-bit dot products feed maddubs (no saturation), besides any bytes
    Buf sm;
    for (auto& x : sm.b) x = uint8_t(rnd() % 16);
    const __m256i u4 = as<__m256i>(sm);

    out("_mm256_add_epi16", t, _mm256_add_epi16(a16, b16));
    out("_mm256_add_epi32", t, _mm256_add_epi32(a32, b32));
    out("_mm256_sub_epi32", t, _mm256_sub_epi32(a32, b32));
    out("_mm256_mullo_epi32", t, _mm256_mullo_epi32(a32, b32));
    out("_mm256_cmpgt_epi32", t, _mm256_cmpgt_epi32(a32, b32));
    out("_mm256_and_si256", t, _mm256_and_si256(a32, b32));
    out("_mm256_or_si256", t, _mm256_or_si256(a32, b32));
    out("_mm256_xor_si256", t, _mm256_xor_si256(a32, b32));
    out("_mm256_abs_epi8", t, _mm256_abs_epi8(a8));
    out("_mm256_sign_epi8", t, _mm256_sign_epi8(a8, b8));
    out("_mm256_blendv_epi8", t, _mm256_blendv_epi8(a8, b8, c8));
    out("_mm256_madd_epi16", t, _mm256_madd_epi16(a16, b16));
    out("_mm256_maddubs_epi16", t * 2, _mm256_maddubs_epi16(a8, b8));
    out("_mm256_maddubs_epi16", t * 2 + 1, _mm256_maddubs_epi16(u4, b8));
    out("_mm256_packs_epi16", t, _mm256_packs_epi16(a16, b16));
    out("_mm256_packs_epi32", t, _mm256_packs_epi32(a32, b32));
    out("_mm256_unpacklo_epi16", t, _mm256_unpacklo_epi16(a16, b16));
    out("_mm256_unpackhi_epi16", t, _mm256_unpackhi_epi16(a16, b16));
    out("_mm256_unpacklo_epi32", t, _mm256_unpacklo_epi32(a32, b32));
    out("_mm256_unpackhi_epi32", t, _mm256_unpackhi_epi32(a32, b32));
    out("_mm256_unpacklo_epi64", t, _mm256_unpacklo_epi64(a32, b32));
    out("_mm256_unpackhi_epi64", t, _mm256_unpackhi_epi64(a32, b32));
    out("_mm256_permutevar8x32_epi32", t, _mm256_permutevar8x32_epi32(a32, b32));
    out("_mm256_cvtepi8_epi16", t, _mm256_cvtepi8_epi16(a8x));
    out("_mm256_cvtepi8_epi32", t, _mm256_cvtepi8_epi32(a8x));
    out("_mm256_cvtepu8_epi32", t, _mm256_cvtepu8_epi32(a8x));
    out("_mm256_cvtepu16_epi32", t, _mm256_cvtepu16_epi32(a16x));
    out("_mm_add_epi32", t, _mm_add_epi32(a32x, b32x));
    out("_mm_packs_epi16", t, _mm_packs_epi16(a16x, a16y));
    out("_mm_packs_epi32", t, _mm_packs_epi32(a32x, b32x));
    out("_mm_packus_epi32", t, _mm_packus_epi32(a32x, b32x));
    out("_mm_unpacklo_epi16", t, _mm_unpacklo_epi16(a16x, a16y));
    out("_mm_unpackhi_epi16", t, _mm_unpackhi_epi16(a16x, a16y));
    out("_mm_unpacklo_epi32", t, _mm_unpacklo_epi32(a32x, b32x));
    out("_mm_unpackhi_epi32", t, _mm_unpackhi_epi32(a32x, b32x));
    out("_mm_unpacklo_epi64", t, _mm_unpacklo_epi64(a32x, b32x));
    out("_mm_unpackhi_epi64", t, _mm_unpackhi_epi64(a32x, b32x));
  }
  // every int16 pair extreme for madd (-32768² twice wraps to INT32_MIN)
  const short ext[] = {-32768, -32767, -1, 0, 1, 32767};
  for (int i = 0; i < 36; ++i) {
    const short x = ext[i % 6], y = ext[i / 6];
    out("_mm256_madd_epi16", kN + i, _mm256_madd_epi16(_mm256_set1_epi16(x), _mm256_set1_epi16(y)));
  }
}

void fp16() {  // every fp16 value
  for (int h = 0; h < 65536; h += 8) {
    uint16_t v[8];
    for (int k = 0; k < 8; ++k) v[k] = uint16_t(h + k);
    __m128i x;
    std::memcpy(&x, v, 16);
    out("_mm256_cvtph_ps", h / 8, _mm256_cvtph_ps(x));
    uint32_t s[8];
    for (int k = 0; k < 8; ++k) s[k] = bits(_cvtsh_ss(v[k]));
    std::printf("_cvtsh_ss %d", h / 8);
    for (uint32_t u : s) std::printf(" %08x", u);
    std::printf("\n");
    ++g_lines;
  }
}

}  // namespace

int main() {
  loads_stores();
  sets_casts();
  fp_ops();
  int_ops();
  fp16();
  sweep<ShufflePs, 256>();
  sweep<ShuffleEpi32, 256>();
  sweep<Permute4x64, 256>();
  sweep<Permute2x128, 256>();
  sweep<Permute2f128, 256>();
  sweep<CmpPs, 32>();
  sweep<Shifts, 35>();
  sweep<RoundPs, 10>();
  std::printf("end %ld\n", g_lines);
  return 0;
}
