// The panel GEMM's tiles (linear.cpp's kernel), shared with quant.cpp's many-row path (AVX-512):
// a panel of kPanel output columns laid out [k / depth][kPanel][depth] (depth 1 for fp32, 2 for
// bf16: a 32-bit lane's pair of k), and the tile of up to kTileRows rows of x that runs over it
// with its sums in registers. With AVX-512 a panel is 64 columns (4 vectors of 16) and a tile 6
// rows (6 x 4 sums + 4 weights: 28 of 32 registers); with AVX2 and FMA (fp32 only), 32 columns
// (4 vectors of 8) and 3 rows (3 x 4 sums + 3 broadcasts of x: 15 of 16 registers, the weights
// read by the FMAs from L1). See linear.cpp for the design.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace actorlm::panel {

#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kTileRows = 6;
#else
constexpr int kLanes = 8;
constexpr int kTileRows = 3;
#endif
constexpr int kVectors = 4;                   // vectors of output columns in a panel
constexpr int kPanel = kLanes * kVectors;     // output columns in a panel

// k of a column in one 32-bit lane: 1 for fp32, 2 for bf16 (carried as its 16 bits)
template <typename T>
constexpr int kDepth = 4 / int(sizeof(T));

#ifdef __AVX512F__
// One k step (kDepth<T> values of k) of rows [0, R): the panel's 64 columns' weights w, each
// row's x at this step, into the sums.
template <typename T, int R>
inline void multiply_add(const T* x, int64_t x_stride, int64_t i, int64_t k, const __m512i* w,
                         __m512 (*sum)[kVectors]) {
  for (int r = 0; r < R; ++r) {
    const T* row = x + r * x_stride + i * kDepth<T>;
    if constexpr (kDepth<T> == 1) {
      const __m512 xr = _mm512_set1_ps(*row);
      for (int v = 0; v < kVectors; ++v)
        sum[r][v] = _mm512_fmadd_ps(xr, _mm512_castsi512_ps(w[v]), sum[r][v]);
    } else {
#ifdef __AVX512BF16__
      uint32_t pair = *row;  // k odd: the last pair's second weight is zero
      if (i * 2 + 1 < k) std::memcpy(&pair, row, sizeof pair);
      const __m512i xr = _mm512_set1_epi32(int(pair));
      for (int v = 0; v < kVectors; ++v)
        sum[r][v] = _mm512_dpbf16_ps(sum[r][v], (__m512bh)xr, (__m512bh)w[v]);
#endif
    }
  }
}

template <typename T>
inline void store_row(T* y, __mmask16 mask, __m512 sum) {
  if constexpr (kDepth<T> == 1) {
    _mm512_mask_storeu_ps(y, mask, sum);
  } else {
#ifdef __AVX512BF16__
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(sum));  // round to nearest even
#endif
  }
}

// rows [0, R) of the tile, columns [0, valid) of the panel. Tile `part` of `parts` over this
// panel also prefetches that share of the next panel into L2: the first tile of a panel waits
// on memory and the others compute from L2, and the prefetch overlaps the two.
template <typename T, int R>
void tile(const T* x, int64_t x_stride, const T* panel, int64_t k, const float* bias, T* y,
          int64_t y_stride, int valid, const T* next, int64_t part, int64_t parts) {
  constexpr int64_t kStep = int64_t(kPanel) * kDepth<T>;  // values of a panel's k step
  const int64_t steps = (k + kDepth<T> - 1) / kDepth<T>;
  __m512 sum[R][kVectors];
  for (int v = 0; v < kVectors; ++v) {
    const __m512 start = bias ? _mm512_loadu_ps(bias + kLanes * v) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) sum[r][v] = start;
  }
  for (int64_t i = 0; i < steps; ++i) {
    if (next) {
      const T* ahead = next + (part * steps + i) / parts * kStep;
      for (int v = 0; v < kVectors; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + kStep / kVectors * v), _MM_HINT_T1);
    }
    __m512i w[kVectors];
    for (int v = 0; v < kVectors; ++v)
      w[v] = _mm512_load_si512(panel + i * kStep + kStep / kVectors * v);
    multiply_add<T, R>(x, x_stride, i, k, w, sum);
  }
  for (int v = 0; v < kVectors; ++v) {
    const int left = valid - kLanes * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    for (int r = 0; r < R; ++r) store_row(y + r * y_stride + kLanes * v, mask, sum[r][v]);
  }
}

template <typename T>
using Tile = void (*)(const T*, int64_t, const T*, int64_t, const float*, T*, int64_t, int,
                      const T*, int64_t, int64_t);
template <typename T>
constexpr Tile<T> kTiles[kTileRows + 1] = {nullptr, tile<T, 1>, tile<T, 2>, tile<T, 3>,
                                          tile<T, 4>, tile<T, 5>, tile<T, 6>};
#define ACTORLM_PANEL_GEMM 1

#elif defined(__AVX2__) && defined(__FMA__)
// fp32 rows [0, R) of the tile, columns [0, valid) of the panel, as the AVX-512 tile computes
// them (each column's sum in k order, one FMA a step), with the same prefetch of the next panel.
template <int R>
void tile(const float* x, int64_t x_stride, const float* panel, int64_t k, const float* bias,
          float* y, int64_t y_stride, int valid, const float* next, int64_t part,
          int64_t parts) {
  __m256 sum[R][kVectors];
  for (int v = 0; v < kVectors; ++v) {
    const __m256 start = bias ? _mm256_loadu_ps(bias + kLanes * v) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) sum[r][v] = start;
  }
  for (int64_t i = 0; i < k; ++i) {
    const float* w = panel + i * kPanel;
    if (next) {  // this tile's share of the next panel, a k step (two 64-byte lines) a step
      const char* ahead = reinterpret_cast<const char*>(next + (part * k + i) / parts * kPanel);
      _mm_prefetch(ahead, _MM_HINT_T1);
      _mm_prefetch(ahead + 64, _MM_HINT_T1);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * x_stride + i);
      for (int v = 0; v < kVectors; ++v)
        sum[r][v] = _mm256_fmadd_ps(xr, _mm256_load_ps(w + kLanes * v), sum[r][v]);
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int v = 0; v < kVectors; ++v) {
    const int left = valid - kLanes * v;
    if (left <= 0) break;
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane);
    for (int r = 0; r < R; ++r) _mm256_maskstore_ps(y + r * y_stride + kLanes * v, mask, sum[r][v]);
  }
}

template <typename T>
using Tile = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*,
                      int64_t, int, const float*, int64_t, int64_t);
template <typename T>
constexpr Tile<T> kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>};
#define ACTORLM_PANEL_GEMM 1
#endif

}  // namespace actorlm::panel
