// bf16 panels (panel.h's layout, [k / 2][64][2]) on AMX tiles, for linear.cpp's GEMM and
// quant_panel.h's dequantized panels. A B tile is 16 pairs of k by 16 columns: a 64-byte slice
// of 16 consecutive panel rows, 256 bytes apart, so the panels need no other layout. Up to 16
// rows of x take one A tile and the panel's 64 columns four C tiles, which start at the bias
// and sum the pairs in k order as the AVX-512 tile does (a last bit differs now and then: the
// tiles round a pair's products otherwise). A thread configures the tiles for its rows
// (`configure`), runs any number of blocks, and releases them (`_tile_release`).
#pragma once
#include <cstdint>

#include "panel.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define ACTORLM_AMX 1

namespace actorlm::panel::amx {

constexpr int kPairs = 16;  // pairs of k in a B tile: 32 values of k a step
constexpr int kRows = 16;   // rows of x in an A tile
constexpr int64_t kRowBytes = kPanel * 4;  // a panel row: the 64 columns' pairs

// Whether bf16 panels run on the tiles: the CPU has them and Linux lets this process use them
// (linear.cpp asks once); actorlm_linear_amx switches it for tests
bool enabled();

struct alignas(64) TileConfig {  // palette 1's layout (Intel SDM, LDTILECFG)
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tiles 0-3: C, rows x 16 fp32 columns each; 4: A, rows x 32 bf16; 5, 6: B, in turn
inline void configure(int rows) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = uint8_t(rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 5; t < 7; ++t) {
    cfg.rows[t] = kPairs;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// y rows [0, rows) (rows y_stride apart), columns [0, valid) = x rows @ the panel + bias (the
// panel's 64 values, or null), the tiles configured for `rows` (<= kRows); k a multiple of 32
inline void rows_times_panel(const uint16_t* x, int64_t x_stride, const uint16_t* panel,
                             int64_t k, const float* bias, uint16_t* y, int64_t y_stride,
                             int rows, int valid) {
  alignas(64) float c[kRows][kPanel];
  if (bias) {  // (a stride of 0: every row of the tile the same 16 values)
    _tile_loadd(0, bias, 0);
    _tile_loadd(1, bias + 16, 0);
    _tile_loadd(2, bias + 32, 0);
    _tile_loadd(3, bias + 48, 0);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t i = 0; i < k; i += 2 * kPairs) {
    const uint16_t* w = panel + i * kPanel;  // pair i / 2's row
    _tile_loadd(4, x + i, x_stride * 2);
    _tile_loadd(5, w, kRowBytes);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, w + 32, kRowBytes);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, w + 64, kRowBytes);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, w + 96, kRowBytes);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, &c[0][0], kRowBytes);
  _tile_stored(1, &c[0][16], kRowBytes);
  _tile_stored(2, &c[0][32], kRowBytes);
  _tile_stored(3, &c[0][48], kRowBytes);
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v * kLanes < valid; ++v) {
      const int left = valid - v * kLanes;
      const __mmask16 mask = left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      store_row(y + r * y_stride + v * kLanes, mask, _mm512_load_ps(&c[r][v * kLanes]));
    }
}

}  // namespace actorlm::panel::amx
#endif
