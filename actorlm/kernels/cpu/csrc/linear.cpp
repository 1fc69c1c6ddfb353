// Linear layers, y = x @ W^T (+ bias), for the few rows of a decode step: fp32 with AVX-512 or
// with AVX2 and FMA (panel.h's narrower tiles), and bf16 where the CPU has avx512_bf16.
//
// With 2 to 32 rows, oneDNN's and MKL's fp32 GEMMs neither stream the weights at the memory's
// speed nor compute at the cores': 16 rows of SmolLM2's layers cost twice what reading the
// weights once does. Here the weight is packed once into panels of 64 output columns,
// [panel][k][64], read front to back; a tile of up to 6 rows keeps its 6 x 4 sums in registers
// and, for each k, loads the panel's 64 weights once and multiplies them into every row (the
// panel stays in L2 for the next tile of rows). bf16 packs two k per column,
// [panel][k / 2][64][2], for _mm512_dpbf16_ps (a pair's two products into an fp32 sum), and
// rounds each sum once, as oneDNN does: at one row it reads the weights at 1.6x oneDNN's speed
// (beyond a few rows oneDNN's AMX GEMM wins over this tile, and the callers keep it, except
// where the tiles below run). Without AVX-512 the library reports it has no such kernel and
// the callers keep oneDNN.
//
// Where the CPU has AMX tiles, bf16 runs on them over the same panels (k a multiple of 32;
// panel_amx.h). From a few rows on the tiles are the faster: 8 rows of a 2048 x 1024 expert 0.15
// against 0.23 ms, 16 rows 0.16 against 0.34, oneDNN's AMX GEMM on its own layout 0.19 at
// either; one or two rows read the weights as fast on either, but a wide layer (an LM head)
// 3-5 % slower on the tiles (Xeon with AMX, 2 cores, the weights from memory). So
// actorlm_linear takes the tiles from 3 rows, and actorlm_linear_rowwise (the routed experts,
// whose rows must not change with the rows sharing their expert) at every row count.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "actorlm_abi.h"
#include "panel.h"
#include "panel_amx.h"

#ifdef ACTORLM_AMX
#include <sys/syscall.h>
#include <unistd.h>

namespace actorlm::panel::amx {

// Linux gives a process the tiles' state only once asked (one request for every thread)
bool permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

// 1: bf16 runs on the tiles; 0: on the AVX-512 tile (actorlm_linear_amx); -1: not yet asked
std::atomic<int> g_enabled{-1};

bool enabled() {
  int on = g_enabled.load(std::memory_order_relaxed);
  if (on < 0) g_enabled.store(on = permitted() ? 1 : 0);
  return on == 1;
}

}  // namespace actorlm::panel::amx
#endif

namespace {

using namespace actorlm::panel;

#ifdef ACTORLM_PANEL_GEMM
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

#ifdef ACTORLM_AMX
namespace tiled {

using namespace actorlm::panel::amx;

void linear(const uint16_t* x, int64_t x_stride, const uint16_t* packed, const float* bias,
            uint16_t* y, int64_t m, int64_t n, int64_t k) {
  const int64_t panels = (n + kPanel - 1) / kPanel, panel_size = k * kPanel;
  const int64_t blocks = (m + kRows - 1) / kRows;
#pragma omp parallel
  {
    int configured = 0;
    // consecutive items are a panel's blocks of rows: the later ones read it from L2
#pragma omp for schedule(static)
    for (int64_t item = 0; item < panels * blocks; ++item) {
      const int64_t p = item / blocks, row = item % blocks * kRows;
      const int rows = int(std::min<int64_t>(kRows, m - row));
      if (rows != configured) configure(configured = rows);
      rows_times_panel(x + row * x_stride, x_stride, packed + p * panel_size, k,
                       bias ? bias + p * kPanel : nullptr, y + row * n + p * kPanel, n, rows,
                       int(std::min<int64_t>(kPanel, n - p * kPanel)));
    }
    _tile_release();
  }
}

}  // namespace tiled
#endif

constexpr int64_t kTilesFromRows = 3;  // actorlm_linear's rows from which the tiles run

// y = x @ W^T + bias in bf16: on the tiles from `tiles_from` rows (where they run), else the
// AVX-512 tile
void linear_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed, const float* bias,
                 uint16_t* y, int64_t m, int64_t n, int64_t k, int64_t tiles_from) {
#ifdef ACTORLM_AMX
  if (m >= tiles_from && k % (2 * tiled::kPairs) == 0 && tiled::enabled())
    return tiled::linear(x, x_stride, packed, bias, y, m, n, k);
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  linear(x, x_stride, packed, bias, y, m, n, k);
#endif
}

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

// packed -> weight [n, k]: pack undone (a GEMM elsewhere, oneDNN's on AMX, reads it plain).
// A panel is [k / d][kPanel] 32-bit lanes and a row k / d of them: a transpose of lanes, done
// in 16 x kPanel blocks so that the 16 lines it reads stay in L1 while they are used up.
template <typename T>
void unpack(const T* packed, T* weight, int64_t n, int64_t k) {
  constexpr int d = kDepth<T>;
  const int64_t panels = (n + kPanel - 1) / kPanel, depth_k = (k + d - 1) / d * d;
  if (k % d == 0) {
    const int64_t lanes = k / d;
    const uint32_t* from = reinterpret_cast<const uint32_t*>(packed);
    uint32_t* to = reinterpret_cast<uint32_t*>(weight);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int columns = int(std::min<int64_t>(kPanel, n - p * kPanel));
      for (int64_t i0 = 0; i0 < lanes; i0 += 16) {
        const int64_t i1 = std::min<int64_t>(i0 + 16, lanes);
        for (int c = 0; c < columns; ++c)
          for (int64_t i = i0; i < i1; ++i)
            to[(p * kPanel + c) * lanes + i] = from[(p * lanes + i) * kPanel + c];
      }
    }
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    for (int c = 0; c < kPanel && p * kPanel + c < n; ++c) {
      T* row = weight + (p * kPanel + c) * k;
      for (int64_t i = 0; i < k; ++i)
        row[i] = packed[((p * depth_k + i - i % d) * kPanel) + c * d + i % d];
    }
  }
}

}  // namespace

extern "C" {

// The columns of a panel (the packed weight's column count is rounded up to it), or 0 where
// this build has no kernel for the dtype.
int actorlm_linear_panel_f32() {
#ifdef ACTORLM_PANEL_GEMM
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

void actorlm_linear_unpack_f32(const float* packed, float* weight, int64_t n, int64_t k) {
  unpack(packed, weight, n, k);
}
void actorlm_linear_unpack_bf16(const uint16_t* packed, uint16_t* weight, int64_t n,
                                int64_t k) {
  unpack(packed, weight, n, k);
}

// y [m, n] = x [m, k] (rows x_stride apart) @ weight^T + bias (fp32, padded to the packed
// columns, or null); the packed weight 64-byte aligned
void actorlm_linear_f32(const float* x, int64_t x_stride, const float* packed, const float* bias,
                        float* y, int64_t m, int64_t n, int64_t k) {
#ifdef ACTORLM_PANEL_GEMM
  linear(x, x_stride, packed, bias, y, m, n, k);
#endif
}
void actorlm_linear_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed,
                         const float* bias, uint16_t* y, int64_t m, int64_t n, int64_t k) {
  linear_bf16(x, x_stride, packed, bias, y, m, n, k, kTilesFromRows);
}

// actorlm_linear, each row computed the same way whatever the number of rows
void actorlm_linear_rowwise_f32(const float* x, int64_t x_stride, const float* packed,
                                const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  actorlm_linear_f32(x, x_stride, packed, bias, y, m, n, k);
}
void actorlm_linear_rowwise_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed,
                                 const float* bias, uint16_t* y, int64_t m, int64_t n,
                                 int64_t k) {
  linear_bf16(x, x_stride, packed, bias, y, m, n, k, 1);
}

// bf16 on the AMX tiles (k a multiple of 32): `on` 1 or 0 chooses (0 for tests: the AVX-512
// tile), anything else only asks; the answer is whether they run now, -1 where this build or
// the kernel (arch_prctl) gives none
int actorlm_linear_amx(int on) {
#ifdef ACTORLM_AMX
  namespace tiles = actorlm::panel::amx;
  if (!tiles::permitted()) return -1;
  if (on == 0 || on == 1) tiles::g_enabled.store(on);
  return tiles::enabled() ? 1 : 0;
#else
  (void)on;
  return -1;
#endif
}

}  // extern "C"
