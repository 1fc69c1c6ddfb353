// Linear layers, y = x @ W^T (+ bias), for the few rows of a decode step, with AVX-512: fp32,
// and bf16 where the CPU has avx512_bf16.
//
// With 2 to 32 rows, oneDNN's and MKL's fp32 GEMMs neither stream the weights at the memory's
// speed nor compute at the cores': 16 rows of SmolLM2's layers cost twice what reading the
// weights once does. Here the weight is packed once into panels of 64 output columns,
// [panel][k][64], read front to back; a tile of up to 6 rows keeps its 6 x 4 sums in registers
// and, for each k, loads the panel's 64 weights once and multiplies them into every row (the
// panel stays in L2 for the next tile of rows). bf16 packs two k per column,
// [panel][k / 2][64][2], for _mm512_dpbf16_ps (a pair's two products into an fp32 sum), and
// rounds each sum once, as oneDNN does: at one row it reads the weights at 1.6x oneDNN's speed
// (beyond a few rows oneDNN's AMX GEMM wins, and the callers keep it). Without AVX-512 the
// library reports it has no such kernel and the callers keep oneDNN.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "actorlm_abi.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;
constexpr int kVectors = 4;                   // vectors of output columns in a panel
constexpr int kPanel = kLanes * kVectors;     // output columns in a panel
constexpr int kTileRows = 6;                  // 6 x 4 sums + 4 weights: 28 of 32 registers

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

template <typename T>
void linear(const T* x, int64_t x_stride, const T* packed, const float* bias, T* y, int64_t m,
            int64_t n, int64_t k) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t panel_size = (k + kDepth<T> - 1) / kDepth<T> * kDepth<T> * kPanel;
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  // a thread's items are consecutive: the tiles of a panel, so it reads the panel from memory
  // once and from its L2 for the other tiles
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < panels * tiles; ++item) {
    const int64_t p = item / tiles, t = item % tiles;
    const int64_t row = t * kTileRows;
    const int rows = int(std::min<int64_t>(kTileRows, m - row));
    kTiles<T>[rows](x + row * x_stride, x_stride, packed + p * panel_size, k,
                    bias ? bias + p * kPanel : nullptr, y + row * n + p * kPanel, n,
                    int(std::min<int64_t>(kPanel, n - p * kPanel)),
                    p + 1 < panels ? packed + (p + 1) * panel_size : nullptr, t, tiles);
  }
}
#endif

// weight [n, k] -> packed [ceil(n / panel), ceil(k / depth), panel, depth], zero past n and k
template <typename T>
void pack(const T* weight, T* packed, int64_t n, int64_t k) {
  constexpr int d = kDepth<T>;
  const int64_t panels = (n + kPanel - 1) / kPanel, depth_k = (k + d - 1) / d * d;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    for (int c = 0; c < kPanel; ++c) {  // a weight row read front to back, into a column
      const int64_t column = p * kPanel + c;
      for (int64_t i = 0; i < depth_k; ++i)
        packed[((p * depth_k + i - i % d) * kPanel) + c * d + i % d] =
            column < n && i < k ? weight[column * k + i] : T(0);
    }
  }
}

}  // namespace

extern "C" {

// The columns of a panel (the packed weight's column count is rounded up to it), or 0 where
// this build has no kernel for the dtype.
int actorlm_linear_panel_f32() {
#ifdef __AVX512F__
  return kPanel;
#else
  return 0;
#endif
}
int actorlm_linear_panel_bf16() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return kPanel;
#else
  return 0;
#endif
}

void actorlm_linear_pack_f32(const float* weight, float* packed, int64_t n, int64_t k) {
  pack(weight, packed, n, k);
}
void actorlm_linear_pack_bf16(const uint16_t* weight, uint16_t* packed, int64_t n, int64_t k) {
  pack(weight, packed, n, k);
}

// y [m, n] = x [m, k] (rows x_stride apart) @ weight^T + bias (fp32, padded to the packed
// columns, or null); the packed weight 64-byte aligned
void actorlm_linear_f32(const float* x, int64_t x_stride, const float* packed, const float* bias,
                        float* y, int64_t m, int64_t n, int64_t k) {
#ifdef __AVX512F__
  linear(x, x_stride, packed, bias, y, m, n, k);
#endif
}
void actorlm_linear_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed,
                         const float* bias, uint16_t* y, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  linear(x, x_stride, packed, bias, y, m, n, k);
#endif
}

}  // extern "C"
