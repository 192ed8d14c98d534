// What the AMX users (amx_linear.cpp, decode_attention.cpp, prefill_attention.cpp) share:
// the tile configuration (the availability check, amx_available, is declared in
// kernels.h). They use only full tiles, 16 rows of 64 bytes (16 fp32 or 32
// bf16), so one configuration serves every tile they touch.
//
// The same sources build two levels (kvserve/kernels/build.py): `amx`, compiled with the AMX
// flags, and `avx512-bf16`, without them. There KVSERVE_AMX is 0, amx_available() is false,
// so no AMX path is ever taken, and the tile calls below are stand-ins that trap: the AMX
// paths still compile, but the build holds no AMX instruction (tests/kernels/test_isa.py
// disassembles it to make sure), so a CPU without AMX can never meet one.
#pragma once
#include <immintrin.h>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVSERVE_AMX 1
#else
#define KVSERVE_AMX 0
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadd(...) __builtin_trap()
#define _tile_stored(...) __builtin_trap()
#define _tile_zero(...) __builtin_trap()
#define _tile_dpbf16ps(...) __builtin_trap()
#define _tile_release() __builtin_trap()
#define _tile_loadconfig(...) __builtin_trap()
#endif

struct alignas(64) AmxTileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0..count-1 as 16 rows × 64 bytes, for the calling thread (tile state is per thread,
// so each parallel region configures on entry and calls _tile_release() on exit).
inline void configure_full_tiles(int count) {
  AmxTileConfig cfg;
  for (int t = 0; t < count; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}
