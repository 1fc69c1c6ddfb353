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
// Where the CPU has AMX tiles, bf16 runs on them over the same panels (k a multiple of 32): a
// B tile is 16 pairs of k by 16 columns, a 64-byte slice of each of 16 consecutive panel rows
// (256 bytes apart), so the packed layout needs no change. Up to 16 rows of x take one A tile
// and the panel's 64 columns four C tiles, which start at the bias and sum the pairs in k order
// as the AVX-512 tile does (a last bit differs now and then: the tiles round a pair's products
// otherwise). From a few rows on the tiles are the faster: 8 rows of a 2048 x 1024 expert 0.15
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define ACTORLM_AMX 1
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
namespace amx {

constexpr int kPairs = 16;  // pairs of k in a B tile: 32 values of k a step
constexpr int kRows = 16;   // rows of x in an A tile
constexpr int kFromRows = 3;  // actorlm_linear's rows from which the tiles run

struct alignas(64) TileConfig {  // palette 1's layout (Intel SDM, LDTILECFG)
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

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

// tiles 0-3: C, rows x 16 fp32 columns each; 4: A, rows x 32 bf16; 5, 6: B, in turn
void configure(int rows) {
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

void linear(const uint16_t* x, int64_t x_stride, const uint16_t* packed, const float* bias,
            uint16_t* y, int64_t m, int64_t n, int64_t k) {
  const int64_t panels = (n + kPanel - 1) / kPanel, panel_size = k * kPanel;
  const int64_t blocks = (m + kRows - 1) / kRows;
  constexpr int64_t kRowBytes = kPanel * 4;  // a panel row: the 64 columns' pairs
#pragma omp parallel
  {
    alignas(64) float c[kRows][kPanel];
    int configured = 0;
    // consecutive items are a panel's blocks of rows: the later ones read it from L2
#pragma omp for schedule(static)
    for (int64_t item = 0; item < panels * blocks; ++item) {
      const int64_t p = item / blocks, row = item % blocks * kRows;
      const int rows = int(std::min<int64_t>(kRows, m - row));
      if (rows != configured) configure(configured = rows);
      if (bias) {  // (a stride of 0: every row of the tile the same 16 values)
        const float* b = bias + p * kPanel;
        _tile_loadd(0, b, 0);
        _tile_loadd(1, b + 16, 0);
        _tile_loadd(2, b + 32, 0);
        _tile_loadd(3, b + 48, 0);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      const uint16_t* a = x + row * x_stride;
      for (int64_t i = 0; i < k; i += 2 * kPairs) {
        const uint16_t* w = packed + p * panel_size + i * kPanel;  // pair i / 2's row
        _tile_loadd(4, a + i, x_stride * 2);
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
      const int valid = int(std::min<int64_t>(kPanel, n - p * kPanel));
      for (int r = 0; r < rows; ++r)
        for (int v = 0; v * kLanes < valid; ++v) {
          const int left = valid - v * kLanes;
          const __mmask16 mask =
              left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
          store_row(y + (row + r) * n + p * kPanel + v * kLanes, mask,
                    _mm512_load_ps(&c[r][v * kLanes]));
        }
    }
    _tile_release();
  }
}

}  // namespace amx
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
#ifdef ACTORLM_AMX
  if (m >= amx::kFromRows && k % (2 * amx::kPairs) == 0 && amx::enabled())
    return amx::linear(x, x_stride, packed, bias, y, m, n, k);
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  linear(x, x_stride, packed, bias, y, m, n, k);
#endif
}

// actorlm_linear, each row computed the same way whatever the number of rows
void actorlm_linear_rowwise_f32(const float* x, int64_t x_stride, const float* packed,
                                const float* bias, float* y, int64_t m, int64_t n, int64_t k) {
  actorlm_linear_f32(x, x_stride, packed, bias, y, m, n, k);
}
void actorlm_linear_rowwise_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed,
                                 const float* bias, uint16_t* y, int64_t m, int64_t n,
                                 int64_t k) {
#ifdef ACTORLM_AMX
  if (k % (2 * amx::kPairs) == 0 && amx::enabled())
    return amx::linear(x, x_stride, packed, bias, y, m, n, k);
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  linear(x, x_stride, packed, bias, y, m, n, k);
#endif
}

// bf16 on the AMX tiles (k a multiple of 32): `on` 1 or 0 chooses (0 for tests: the AVX-512
// tile), anything else only asks; the answer is whether they run now, -1 where this build or
// the kernel (arch_prctl) gives none
int actorlm_linear_amx(int on) {
#ifdef ACTORLM_AMX
  if (!amx::permitted()) return -1;
  if (on == 0 || on == 1) amx::g_enabled.store(on);
  return amx::enabled() ? 1 : 0;
#else
  (void)on;
  return -1;
#endif
}

}  // extern "C"
