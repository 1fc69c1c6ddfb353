// fp32 linear layers, y = x @ W^T (+ bias), for the few rows of a decode step, with AVX-512.
//
// With 2 to 32 rows, oneDNN's and MKL's fp32 GEMMs neither stream the weights at the memory's
// speed nor compute at the cores': 16 rows of SmolLM2's layers cost twice what reading the
// weights once does. Here the weight is packed once into panels of 64 output columns,
// [panel][k][64], read front to back; a tile of up to 6 rows keeps its 6 x 4 sums in registers
// and, for each k, loads the panel's 64 weights once and multiplies them into every row (the
// panel stays in L2 for the next tile of rows). Without AVX-512 the library reports it has no
// such kernel and the callers keep oneDNN.
#include <algorithm>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;
constexpr int kVectors = 4;                   // vectors of output columns in a panel
constexpr int kPanel = kLanes * kVectors;     // output columns in a panel
constexpr int kTileRows = 6;                  // 6 x 4 sums + 4 weights: 28 of 32 registers

#ifdef __AVX512F__
// rows [0, R) of the tile, columns [0, valid) of the panel. Tile `part` of `parts` over this
// panel also prefetches that share of the next panel into L2: the first tile of a panel waits
// on memory and the others compute from L2, and the prefetch overlaps the two.
template <int R>
void tile(const float* x, int64_t x_stride, const float* panel, int64_t k, const float* bias,
          float* y, int64_t y_stride, int valid, const float* next, int64_t part, int64_t parts) {
  __m512 sum[R][kVectors];
  for (int v = 0; v < kVectors; ++v) {
    const __m512 start = bias ? _mm512_loadu_ps(bias + kLanes * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) sum[r][v] = start;
  }
  for (int64_t i = 0; i < k; ++i) {
    if (next) {
      const float* ahead = next + (part * k + i) / parts * kPanel;
      for (int v = 0; v < kVectors; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + kLanes * v), _MM_HINT_T1);
    }
    __m512 w[kVectors];
    for (int v = 0; v < kVectors; ++v) w[v] = _mm512_load_ps(panel + i * kPanel + kLanes * v);
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * x_stride + i]);
      for (int v = 0; v < kVectors; ++v) sum[r][v] = _mm512_fmadd_ps(xr, w[v], sum[r][v]);
    }
  }
  for (int v = 0; v < kVectors; ++v) {
    const int left = valid - kLanes * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * y_stride + kLanes * v, mask, sum[r][v]);
  }
}

using Tile = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t,
                      int, const float*, int64_t, int64_t);
constexpr Tile kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};
#endif

}  // namespace

extern "C" {

// The columns of a panel (the packed weight's column count is rounded up to it), or 0 where
// this build has no kernel.
int actorlm_linear_panel_f32() {
#ifdef __AVX512F__
  return kPanel;
#else
  return 0;
#endif
}

// weight [n, k] -> packed [ceil(n / panel), k, panel], columns past n zero
void actorlm_linear_pack_f32(const float* weight, float* packed, int64_t n, int64_t k) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    for (int c = 0; c < kPanel; ++c) {  // a weight row read front to back, into a column
      const int64_t column = p * kPanel + c;
      for (int64_t i = 0; i < k; ++i)
        packed[(p * k + i) * kPanel + c] = column < n ? weight[column * k + i] : 0.f;
    }
  }
}

// y [m, n] = x [m, k] (rows x_stride apart) @ weight^T + bias (padded to the packed columns, or
// null); the packed weight 64-byte aligned
void actorlm_linear_f32(const float* x, int64_t x_stride, const float* packed, const float* bias,
                        float* y, int64_t m, int64_t n, int64_t k) {
#ifdef __AVX512F__
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  // a thread's items are consecutive: the tiles of a panel, so it reads the panel from memory
  // once and from its L2 for the other tiles
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < panels * tiles; ++item) {
    const int64_t p = item / tiles, t = item % tiles;
    const int64_t row = t * kTileRows;
    const int rows = int(std::min<int64_t>(kTileRows, m - row));
    kTiles[rows](x + row * x_stride, x_stride, packed + p * k * kPanel, k,
                 bias ? bias + p * kPanel : nullptr, y + row * n + p * kPanel, n,
                 int(std::min<int64_t>(kPanel, n - p * kPanel)),
                 p + 1 < panels ? packed + (p + 1) * k * kPanel : nullptr, t, tiles);
  }
#endif
}

}  // extern "C"
