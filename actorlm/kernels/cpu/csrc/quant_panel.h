// quant.cpp's many-row path (prefill, large batches): each thread dequantizes a panel of 64
// weight rows into x's dtype (row by row, vectorised: quant_vnni_rows.h), transposes it 16 x 16
// in registers into the layout linear.cpp's panel GEMM reads, in an L2-sized buffer of its
// own, and runs that GEMM's tiles (panel.h) for its rows of x over it.
//
// From about a dozen rows on (bf16; fp32 and the K formats later: quant.cpp's kPanelFromRows)
// the dense tile beats the integer dot products: it does 32 (bf16, dpbf16) or 16 (fp32, FMA)
// multiply-adds an instruction on registers it keeps, where the integer path spends four
// instructions on 64 per row of x (dpbusd, a conversion, a scale, an FMA); the panel's
// dequantization is paid once for all the rows. The numbers change:
// x is not quantized, and in bf16 each dequantized weight (exact in fp32) is rounded to bf16,
// as a dense bf16 copy of the model would hold it; fp32 keeps it exact.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "actorlm_abi.h"
#include "dtype.h"
#include "panel.h"
#include "panel_amx.h"
#include "quant_blocks.h"
#include "quant_interleaved.h"
#include "quant_vnni_rows.h"

namespace actorlm::quant {

using actorlm::store;

template <typename T>
constexpr bool kHasPanels =
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    true;
#elif defined(__AVX512F__)
    sizeof(T) == 4;
#else
    false;
#endif

#ifdef __AVX512F__

// The rows of a layer, its parts stacked
struct LayerRows {
  const actorlm_linear& l;
  const int64_t* first_row;  // [num_parts + 1]
  int64_t k;
  uint64_t call = next_call();  // which call these rows serve (a gathered group's key)

  static uint64_t next_call() {
    static std::atomic<uint64_t> calls{0};
    return ++calls;
  }

  // global row `row` dequantized into out [k] (rounded once to T)
  template <typename T>
  void dequantize(int64_t row, T* out) const {
    int p = 0;
    while (row >= first_row[p + 1]) ++p;
    const int type = type_index(l.parts[p].type);
    const Format f = kFormats[type];
    const uint8_t* w = static_cast<const uint8_t*>(l.parts[p].blocks) +
                       (row - first_row[p]) * (k / f.values * f.bytes);
#ifdef ACTORLM_QUANT_VNNI
    if (l.parts[p].layout != 0) {  // 16 rows interleaved: their group gathered back first
      const uint8_t* part = static_cast<const uint8_t*>(l.parts[p].blocks);
      const int64_t r = row - first_row[p], blocks = k / 32, row_bytes = blocks * f.bytes;
      thread_local std::unique_ptr<uint8_t[]> gathered;
      thread_local int64_t size = 0;
      // the group last gathered, and in which call (the panels ask row by row)
      thread_local const uint8_t* gathered_group = nullptr;
      thread_local uint64_t gathered_call = 0;
      const uint8_t* group = part + r / 16 * 16 * row_bytes;
      if (16 * row_bytes > size) {
        gathered.reset(new uint8_t[size = 16 * row_bytes]);
        gathered_group = nullptr;
      }
      if (group != gathered_group || call != gathered_call) {
        if (kTypes[type] == kQ4_0) interleaved::file_rows<kQ4_0>(part, r / 16, blocks, gathered.get());
        if (kTypes[type] == kQ4_1) interleaved::file_rows<kQ4_1>(part, r / 16, blocks, gathered.get());
        if (kTypes[type] == kQ5_0) interleaved::file_rows<kQ5_0>(part, r / 16, blocks, gathered.get());
        if (kTypes[type] == kQ8_0) interleaved::file_rows<kQ8_0>(part, r / 16, blocks, gathered.get());
        gathered_group = group, gathered_call = call;
      }
      w = gathered.get() + r % 16 * row_bytes;
    }
    switch (kTypes[type]) {  // vectorised
      case kQ4_0: return vnni::dequantize_row32<kQ4_0>(w, k / 32, out);
      case kQ4_1: return vnni::dequantize_row32<kQ4_1>(w, k / 32, out);
      case kQ5_0: return vnni::dequantize_row32<kQ5_0>(w, k / 32, out);
      case kQ8_0: return vnni::dequantize_row32<kQ8_0>(w, k / 32, out);
      case kQ4_K: return vnni::dequantize_row_k<kQ4_K>(w, k / 256, out);
      case kQ5_K: return vnni::dequantize_row_k<kQ5_K>(w, k / 256, out);
      case kQ6_K: return vnni::dequantize_row_k<kQ6_K>(w, k / 256, out);
      default: break;
    }
#endif
    float v[256];
    for (int64_t b = 0; b < k / f.values; ++b) {
      dequantize_block(type, w + b * f.bytes, v);
      for (int i = 0; i < f.values; ++i) store(v[i], out + b * f.values + i);
    }
  }
};

// The lane indices of transpose16's rounds: [round][low, high][lane]
struct alignas(64) TransposeIndex {
  int32_t lanes[4][2][16];
};
constexpr TransposeIndex transpose_index() {
  TransposeIndex t{};
  for (int round = 0, b = 8; round < 4; ++round, b /= 2)
    for (int l = 0; l < 16; ++l) {
      t.lanes[round][0][l] = l & b ? 16 + l - b : l;
      t.lanes[round][1][l] = l & b ? 16 + l : l + b;
    }
  return t;
}
inline constexpr TransposeIndex kTransposeIndex = transpose_index();

// r[0..16) transposed as a 16 x 16 matrix of 32-bit values, in four rounds: rows i and i + b
// (b = 8, 4, 2, 1) trade the b-blocks that lie across the diagonal
template <int kRound = 0>
inline void transpose16(__m512i* r) {
  constexpr int b = 8 >> kRound;
  const __m512i lo = _mm512_load_si512(kTransposeIndex.lanes[kRound][0]);
  const __m512i hi = _mm512_load_si512(kTransposeIndex.lanes[kRound][1]);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i & b) continue;
    const __m512i a = r[i];
    r[i] = _mm512_permutex2var_epi32(a, lo, r[i + b]);
    r[i + b] = _mm512_permutex2var_epi32(a, hi, r[i + b]);
  }
  if constexpr (kRound < 3) transpose16<kRound + 1>(r);
}

// panel [k / depth][64][depth] of the row-major rows [64][k] (k a multiple of 32): 16 x 16
// tiles of 32-bit values (a bf16 pair each, or an fp32) transposed in registers, so that both
// sides are read and written a cache line at a time
template <typename T>
void transpose_into_panel(const T* rows, int64_t k, T* panel) {
  constexpr int kDepth = panel::kDepth<T>;
  const int64_t words = k / kDepth;  // 32-bit values in a row
  const uint32_t* from = reinterpret_cast<const uint32_t*>(rows);
  uint32_t* to = reinterpret_cast<uint32_t*>(panel);
  for (int64_t w0 = 0; w0 < words; w0 += 16)
    for (int c0 = 0; c0 < panel::kPanel; c0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(from + (c0 + i) * words + w0);
      transpose16(r);
      for (int t = 0; t < 16; ++t) _mm512_store_si512(to + (w0 + t) * panel::kPanel + c0, r[t]);
    }
}

template <typename T>
T* panel_buffer(int64_t elements) {  // this thread's, kept between calls
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<T, Free> memory;
  thread_local int64_t size = 0;
  if (elements > size) {
    size = elements;
    memory.reset(static_cast<T*>(std::aligned_alloc(64, (elements * sizeof(T) + 63) / 64 * 64)));
  }
  return memory.get();
}

// y [m, n] = x [m, k] @ W^T + bias through dequantized panels
template <typename T>
void panel_linear(const LayerRows& layer, const T* x, int64_t x_stride, T* y, int64_t m,
                  int threads) {
  using panel::kPanel;
  const int64_t n = layer.l.out_features, k = layer.k;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t tiles = (m + panel::kTileRows - 1) / panel::kTileRows;
  // too few panels for the threads: each panel's rows of x split between several (each
  // dequantizes it: a small cost against the GEMM of those rows)
  const int64_t groups = std::min(tiles, std::max<int64_t>(1, 2 * threads / panels));
  const int64_t tiles_per_group = (tiles + groups - 1) / groups;
#ifdef ACTORLM_AMX
  const bool on_tiles = sizeof(T) == 2 && panel::amx::enabled();  // bf16 (k: whole blocks)
#endif
#pragma omp parallel
  {
    T* const buffer = panel_buffer<T>(2 * k * kPanel);  // the panel, then its rows
    T* const rows = buffer + k * kPanel;
    int64_t held = -1;  // the panel in the buffer
    [[maybe_unused]] int configured = 0;  // the rows the tiles are configured for
#pragma omp for schedule(static)
    for (int64_t item = 0; item < panels * groups; ++item) {
      const int64_t p = item / groups, g = item % groups;
      const int valid = int(std::min<int64_t>(kPanel, n - p * kPanel));
      if (held != p) {
        for (int c = 0; c < valid; ++c) layer.dequantize(p * kPanel + c, rows + c * k);
        std::memset(rows + valid * k, 0, (kPanel - valid) * k * sizeof(T));
        transpose_into_panel(rows, k, buffer);
        held = p;
      }
      float bias[kPanel] = {};
      if (layer.l.bias) std::memcpy(bias, layer.l.bias + p * kPanel, valid * sizeof(float));
      const int64_t end = std::min(tiles, (g + 1) * tiles_per_group);
#ifdef ACTORLM_AMX
      if constexpr (sizeof(T) == 2) {
        if (on_tiles) {  // the group's rows in blocks of up to 16, on the tiles
          const int64_t last = std::min(m, end * panel::kTileRows);
          for (int64_t row = g * tiles_per_group * panel::kTileRows; row < last;
               row += panel::amx::kRows) {
            const int block = int(std::min<int64_t>(panel::amx::kRows, last - row));
            if (block != configured) panel::amx::configure(configured = block);
            panel::amx::rows_times_panel(x + row * x_stride, x_stride, buffer, k,
                                         layer.l.bias ? bias : nullptr, y + row * n + p * kPanel,
                                         n, block, valid);
          }
          continue;
        }
      }
#endif
      for (int64_t t = g * tiles_per_group; t < end; ++t) {
        const int64_t row = t * panel::kTileRows;
        const int tile_rows = int(std::min<int64_t>(panel::kTileRows, m - row));
        panel::kTiles<T>[tile_rows](x + row * x_stride, x_stride, buffer, k,
                               layer.l.bias ? bias : nullptr, y + row * n + p * kPanel, n, valid,
                               nullptr, 0, 1);
      }
    }
#ifdef ACTORLM_AMX
    if (configured) _tile_release();
#endif
  }
}

#endif

}  // namespace actorlm::quant
