// What the AMX users (amx_linear.cpp, decode_attention.cpp, prefill_attention.cpp) share:
// the tile configuration (the availability checks, amx_available and amx_attention_on, are
// declared in kernels.h). They use only full tiles, 16 rows of 64 bytes (16 fp32 or 32
// bf16), so one configuration serves every tile they touch.
#pragma once
#include <immintrin.h>
#include <cstdint>

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
