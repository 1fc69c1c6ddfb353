// Linear layers over weights in GGML's block formats (quant_blocks.h), y = x @ W^T + bias, for
// decode's few rows and prefill's many, and the dequantized rows of such a weight (embedding
// lookups).
//
// Few rows (decode), following ggml's design: x is quantized to int8 per block once per call
// (quant_act.h), and each weight row's blocks are unpacked once and dotted with up to
// kTileRows rows of x as integers, scaled and summed in fp32 (quant_vnni.h / quant_vnni_k.h,
// quant_avx2.h, quant_scalar.h: one of them runs, chosen at run time among those compiled in,
// by default the best this CPU has). A thread takes a run of weight rows and, for every tile
// of x rows, sweeps that run: the run (kRunBytes) stays in its L2 across the tiles, so the
// weight is read from memory once per call whatever m is, and one row streams it at about
// the memory's speed (two Zen 4 cores: 20-25 GB/s, what a dense bf16 kernel gets too).
// Many rows (prefill, big batches; kPanelFromRows): the weights dequantized panel by panel
// and multiplied by linear.cpp's dense tiles (quant_panel.h), where AVX-512 is there. A part
// whose rows are interleaved 16 by 16 (layout 1, quant_interleaved.h: Q4_0, Q4_1, Q5_0, Q8_0
// under VNNI) runs its own integer kernels below kInterleavedPanelFromRows, and its rows
// gathered back for the panels.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <array>
#include <memory>
#include <utility>

#include <omp.h>

#include "actorlm_abi.h"
#include "dtype.h"
#include "quant_act.h"
#include "quant_avx2.h"
#include "quant_blocks.h"
#include "quant_interleaved.h"
#include "quant_panel.h"
#include "quant_scalar.h"
#include "quant_vnni.h"
#include "quant_vnni_k.h"

namespace {

using namespace actorlm::quant;
using actorlm::store;
using actorlm::to_float;

enum Isa { kScalar = 0, kAvx2 = 1, kVnni = 2, kNumIsas = 3 };

constexpr int kTileRows = 4;            // rows of x a weight row's unpacking serves
constexpr int64_t kRunBytes = 32 << 10;  // weight rows a thread sweeps for each tile of x
constexpr int64_t kChunkRows = 64;       // weight rows a kernel call takes
// x rows from which the panel path runs, [K formats][bf16] (measured with 1 and 2 threads on
// SmolLM2's shapes: benchmarks/quant_gemv.py --paths). The K formats' integer path does 64
// multiply-adds in two instructions (maddubs, dpwssd), so the panel pays off later for them.
constexpr int kPanelFromRows[2][2] = {{32, 12}, {192, 32}};
// The same for a part interleaved 16 by 16, [bf16]: its integer kernel runs 1.3-1.6x the
// panels up to ~128 rows in bf16 and 1.5-3x them in fp32 at every measured size (to 1,024),
// so fp32 never takes the panels (kNever). Its int8 x is the decode step's: a prompt's
// positions then see the same arithmetic as the tokens decoded after them.
constexpr int kNever = 1 << 30;
constexpr int kInterleavedPanelFromRows[2] = {kNever, 192};
// ... and in bf16 where the panels run on AMX tiles (panel_amx.h): SmolLM2's Q4_1 layers at 48
// rows 0.32 against 0.37 ms (gate/up), at 128 rows 0.49 against 0.94, on a Xeon with AMX
constexpr int kInterleavedOnTilesFromRows = 48;

// out[i R + r] = weight row i (`blocks` blocks at w + i row_bytes) . quantized x row row0 + r,
// for i < num_rows, r < R: a loop over rows around the inlined kernel (a call per weight row
// cost as much as a 576-wide row's work)
using Dot = void (*)(const uint8_t* w, int64_t row_bytes, int64_t num_rows, int64_t blocks,
                     const Activations& x, int64_t row0, float* out);

template <template <int, int> class Kernel, int Type, int... R>
constexpr auto tiles(std::integer_sequence<int, R...>) {
  return std::array<Dot, kTileRows>{&Kernel<Type, R + 1>::run...};
}

// Each ISA's kernels as class templates (Kernel<Type, R>::run), for tiles()
#define ACTORLM_KERNEL_OF(NS)                                                                \
  template <int Type, int R>                                                                 \
  struct NS##_kernel {                                                                       \
    static void run(const uint8_t* w, int64_t row_bytes, int64_t num_rows, int64_t blocks,    \
                    const Activations& x, int64_t row0, float* out) {                        \
      for (int64_t i = 0; i < num_rows; ++i) {                                               \
        if constexpr (kFormats[type_index(Type)].values == 32)                               \
          NS::dot32<Type, R>(w + i * row_bytes, blocks, x, row0, out + i * R);               \
        else                                                                                 \
          NS::dot_k<Type, R>(w + i * row_bytes, blocks, x, row0, out + i * R);               \
      }                                                                                      \
    }                                                                                        \
  };
ACTORLM_KERNEL_OF(scalar)
#ifdef ACTORLM_QUANT_AVX2
ACTORLM_KERNEL_OF(avx2)
#endif
#ifdef ACTORLM_QUANT_VNNI
ACTORLM_KERNEL_OF(vnni)
#endif

using TypeTiles = std::array<Dot, kTileRows>;
template <template <int, int> class Kernel>
constexpr std::array<TypeTiles, kNumTypes> kernels_of() {
  constexpr auto r = std::make_integer_sequence<int, kTileRows>{};
  return {tiles<Kernel, kQ4_0>(r), tiles<Kernel, kQ4_1>(r), tiles<Kernel, kQ5_0>(r),
          tiles<Kernel, kQ8_0>(r), tiles<Kernel, kQ4_K>(r), tiles<Kernel, kQ5_K>(r),
          tiles<Kernel, kQ6_K>(r)};
}

// [isa][type index][rows - 1]; an ISA not compiled in has none
const std::array<TypeTiles, kNumTypes> kKernels[kNumIsas] = {
    kernels_of<scalar_kernel>(),
#ifdef ACTORLM_QUANT_AVX2
    kernels_of<avx2_kernel>(),
#else
    {},
#endif
#ifdef ACTORLM_QUANT_VNNI
    kernels_of<vnni_kernel>(),
#else
    {},
#endif
};

// The interleaved kernels, [Q4_0, Q4_1, Q5_0, Q8_0][rows - 1]; parts are interleaved only where
// the CPU runs VNNI (actorlm_quant_interleave)
using Dot16 = void (*)(const uint8_t* w, int64_t num_groups, int64_t blocks, const Activations& x,
                       int64_t row0, float* out);
#ifdef ACTORLM_QUANT_VNNI
template <int Type, int... R>
constexpr std::array<Dot16, kTileRows> tiles16(std::integer_sequence<int, R...>) {
  return {&interleaved::dot16<Type, R + 1>...};
}
constexpr auto kRowsSeq = std::make_integer_sequence<int, kTileRows>{};
const std::array<Dot16, kTileRows> kInterleaved[4] = {
    tiles16<kQ4_0>(kRowsSeq), tiles16<kQ4_1>(kRowsSeq), tiles16<kQ5_0>(kRowsSeq),
    tiles16<kQ8_0>(kRowsSeq)};
inline Dot16 interleaved_tiles(int type, int tile) {
  return kInterleaved[type == kQ4_0 ? 0 : type == kQ4_1 ? 1 : type == kQ5_0 ? 2 : 3][tile];
}
#else
inline Dot16 interleaved_tiles(int, int) { return nullptr; }  // no part is interleaved
#endif

bool can_run(int isa) {
  switch (isa) {
    case kScalar: return true;
#ifdef ACTORLM_QUANT_AVX2
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
#ifdef ACTORLM_QUANT_VNNI
    case kVnni:
      return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
#endif
    default: return false;
  }
}

int best_isa() {
  for (int isa = kNumIsas - 1; isa > kScalar; --isa)
    if (can_run(isa)) return isa;
  return kScalar;
}

const int g_best_isa = best_isa();
std::atomic<int> g_isa{g_best_isa};
std::atomic<int> g_panel_override{0};  // tests and benchmarks: rows for every layer, or 0

// The x rows from which a layer runs the panel path in fp32 or bf16; 0: never
int panel_from_rows(const actorlm_linear& l, bool bf16) {
  if (!(bf16 ? kHasPanels<uint16_t> : kHasPanels<float>) || g_isa.load() != g_best_isa) return 0;
  if (const int rows = g_panel_override.load()) return rows;
  int rows = 0;
  for (int p = 0; p < l.num_parts; ++p) {
    const int type = type_index(l.parts[p].type);
    if (type < 0) return 0;
    const int interleaved =
#ifdef ACTORLM_AMX
        bf16 && actorlm::panel::amx::enabled() ? kInterleavedOnTilesFromRows :
#endif
        kInterleavedPanelFromRows[bf16];
    rows = std::max(rows, l.parts[p].layout != 0 ? interleaved
                                                 : kPanelFromRows[kFormats[type].values == 256][bf16]);
  }
  return rows == kNever ? 0 : rows;
}

// The caller's scratch for the quantized x, kept between calls (a prefill's would otherwise be
// mapped and faulted in anew each call)
char* scratch(int64_t bytes) {
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<char, Free> memory;
  thread_local int64_t size = 0;
  if (bytes > size) {
    size = round_up(std::max<int64_t>(bytes, 2 * size), kAlign);
    memory.reset(static_cast<char*>(std::aligned_alloc(kAlign, size)));
  }
  return memory.get();
}

inline int64_t row_bytes(int type, int64_t in_features) {
  return in_features / kFormats[type].values * kFormats[type].bytes;
}

// A part's rows cut into runs of about kRunBytes, their number a multiple of the threads
struct Runs {
  int64_t count, rows_each;
};
inline Runs runs_of(const actorlm_quant_part& part, int64_t in_features, int threads) {
  const int64_t bytes = part.rows * row_bytes(type_index(part.type), in_features);
  const int64_t count = round_up((bytes + kRunBytes - 1) / kRunBytes, threads);
  const int64_t whole = part.layout != 0 ? 16 : 1;  // an interleaved part's groups stay whole
  const int64_t rows_each = round_up(std::max<int64_t>(1, (part.rows + count - 1) / count), whole);
  return {(part.rows + rows_each - 1) / rows_each, rows_each};
}

constexpr int kMaxParts = 8;  // a layer's parts (quant.py checks)

template <typename T>
void quant_linear(const actorlm_linear& l, const T* x, int64_t x_stride, T* y, int64_t m) {
  const int64_t k = l.in_features, n = l.out_features;
  const int num_parts = l.num_parts;
  if (m <= 0 || n <= 0 || num_parts <= 0 || num_parts > kMaxParts) return;
  bool needs_32 = false, needs_256 = false;
  Runs runs[kMaxParts];
  int64_t first_run[kMaxParts + 1] = {0}, first_row[kMaxParts + 1] = {0};
  const int threads = omp_get_max_threads();
  for (int p = 0; p < num_parts; ++p)
    if (type_index(l.parts[p].type) < 0) return;  // not a kept type: the caller checks first
  for (int p = 0; p < num_parts; ++p) {
    (kFormats[type_index(l.parts[p].type)].values == 32 ? needs_32 : needs_256) = true;
    runs[p] = runs_of(l.parts[p], k, threads);
    first_run[p + 1] = first_run[p] + runs[p].count;
    first_row[p + 1] = first_row[p] + l.parts[p].rows;
  }
#ifdef __AVX512F__
  // The panel path needs AVX-512: a forced lesser ISA (emulating a lesser CPU) turns it off
  const int panel_from = panel_from_rows(l, sizeof(T) == 2);
  if (kHasPanels<T> && panel_from > 0 && m >= panel_from)
    return panel_linear(LayerRows{l, first_row, k}, x, x_stride, y, m, threads);
#endif
  const Activations a = lay_out(scratch(activations_bytes(m, k)), m, k);
  const auto& kernels = kKernels[g_isa.load(std::memory_order_relaxed)];
  auto quantize_x = [&](int64_t r) {
    if (needs_32) quantize_row_32(x + r * x_stride, a, r);
    if (needs_256) quantize_row_256(x + r * x_stride, a, r);
  };
  // fewer rows than threads (decode): quantized before the team starts, a barrier fewer
  const bool x_in_team = m >= threads;
  for (int64_t r = 0; !x_in_team && r < m; ++r) quantize_x(r);
#pragma omp parallel
  {
    if (x_in_team) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < m; ++r) quantize_x(r);
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < first_run[num_parts]; ++item) {
      int p = 0;
      while (item >= first_run[p + 1]) ++p;
      const actorlm_quant_part& part = l.parts[p];
      const int type = type_index(part.type);
      const int64_t bytes = row_bytes(type, k), blocks = k / kFormats[type].values;
      const int64_t begin = (item - first_run[p]) * runs[p].rows_each;
      const int64_t end = std::min(part.rows, begin + runs[p].rows_each);
      const uint8_t* w = static_cast<const uint8_t*>(part.blocks);
      for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
        const int rows = int(std::min<int64_t>(kTileRows, m - r0));
        const Dot dot = kernels[type][rows - 1];
        for (int64_t i0 = begin; i0 < end; i0 += kChunkRows) {
          const int64_t count = std::min<int64_t>(kChunkRows, end - i0);
          float out[kChunkRows * kTileRows];
          if (part.layout != 0)  // (rows i0 .. i0 + count: whole groups, as bytes as the file's)
            interleaved_tiles(part.type, rows - 1)(w + i0 * bytes, count / 16, blocks, a, r0, out);
          else
            dot(w + i0 * bytes, bytes, count, blocks, a, r0, out);
          for (int64_t i = 0; i < count; ++i) {
            const int64_t column = first_row[p] + i0 + i;
            const float bias = l.bias ? l.bias[column] : 0.f;
            for (int t = 0; t < rows; ++t)
              store(out[i * rows + t] + bias, y + (r0 + t) * n + column);
          }
        }
      }
    }
  }
}

template <typename T>
void dequantize_rows(const actorlm_quant_part& part, int64_t in_features, const int64_t* rows,
                     int64_t num_rows, T* out) {
  const int type = type_index(part.type);
  if (type < 0) return;
  const int values = kFormats[type].values;
  const int64_t bytes = row_bytes(type, in_features), blocks = in_features / values;
  const uint8_t* w = static_cast<const uint8_t*>(part.blocks);
#ifndef ACTORLM_QUANT_VNNI
  if (part.layout != 0) return;  // (no interleaved part without the VNNI kernels)
#endif
#ifdef __AVX512F__
  // the panels' row dequantizer (vectorised, the same values): a whole weight dequantized for
  // a GEMM on AMX (QuantLinear.dequantized) took 3-4x longer block by block
  const actorlm_quant_part parts[1] = {part};
  const actorlm_linear one{nullptr, nullptr, 0, in_features, parts, 1};
  const int64_t first_row[2] = {0, INT64_MAX};
  const LayerRows layer{one, first_row, in_features};
#pragma omp parallel for schedule(static) if (num_rows * in_features > (1 << 16))
  for (int64_t r = 0; r < num_rows; ++r) layer.dequantize(rows[r], out + r * in_features);
  return;
#endif
#pragma omp parallel for schedule(static) if (num_rows * in_features > (1 << 16))
  for (int64_t r = 0; r < num_rows; ++r) {
    float values_of_block[256];
    uint8_t file_block[64];  // an interleaved type's block (Q8_0's 34 bytes at most)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = w + rows[r] * bytes + b * kFormats[type].bytes;
#ifdef ACTORLM_QUANT_VNNI
      if (part.layout != 0) {
        interleaved::file_block(part.type, w, blocks, rows[r], b, file_block);
        block = file_block;
      }
#endif
      dequantize_block(type, block, values_of_block);
      T* to = out + r * in_features + b * values;
      for (int i = 0; i < values; ++i) store(values_of_block[i], to + i);
    }
  }
}

}  // namespace

extern "C" {

int actorlm_quant_isa() { return g_isa.load(); }

int actorlm_quant_set_isa(int isa) {
  if (isa < 0 || isa >= kNumIsas || kKernels[isa][0][0] == nullptr || !can_run(isa)) return -1;
  g_isa.store(isa);
  return isa;
}

int actorlm_quant_kept(int32_t type) { return type_index(type) >= 0; }

// dst = the part's rows (rows a multiple of 16, each in_features values of `type`) with 16 rows
// interleaved (quant_interleaved.h), for a part of layout 1; 0 where the ISA in use is not VNNI
// or the type has no such kernel (dst untouched), else 1; dst null: only whether it would
int actorlm_quant_interleave(int32_t type, const uint8_t* src, int64_t rows, int64_t in_features,
                             uint8_t* dst) {
#ifdef ACTORLM_QUANT_VNNI
  if (!interleaved::kept(type) || rows % interleaved::kRows || g_isa.load() != kVnni ||
      in_features % 32)
    return 0;
  if (dst == nullptr) return 1;
  const int64_t blocks = in_features / 32;
  if (type == kQ4_0) interleaved::interleave<kQ4_0>(src, rows, blocks, dst);
  if (type == kQ4_1) interleaved::interleave<kQ4_1>(src, rows, blocks, dst);
  if (type == kQ5_0) interleaved::interleave<kQ5_0>(src, rows, blocks, dst);
  if (type == kQ8_0) interleaved::interleave<kQ8_0>(src, rows, blocks, dst);
  return 1;
#else
  return 0;
#endif
}

// The x rows from which the layer runs the dequantized-panel path in fp32 (bf16: in bf16); 0
// where it never does: this build has no such path, or the ISA in use is not the CPU's best
int actorlm_quant_panel_from_rows(const actorlm_linear* linear, int bf16) {
  return panel_from_rows(*linear, bf16 != 0);
}
// The rows from which every layer runs it (rows < 1: back to each layer's measured default)
void actorlm_quant_set_panel_from_rows(int rows) { g_panel_override.store(std::max(0, rows)); }

// y [m, out_features] = x [m, in_features] (rows x_stride apart) @ W^T + bias, W the parts'
// rows stacked; each part's type kept and in_features a multiple of its block
void actorlm_quant_linear_f32(const actorlm_linear* linear, const float* x, int64_t x_stride,
                              float* y, int64_t m) {
  quant_linear(*linear, x, x_stride, y, m);
}
void actorlm_quant_linear_bf16(const actorlm_linear* linear, const uint16_t* x,
                               int64_t x_stride, uint16_t* y, int64_t m) {
  quant_linear(*linear, x, x_stride, y, m);
}

// out [num_rows, in_features] = rows `rows` of the part, dequantized as gguf.quants does
void actorlm_quant_dequantize_rows_f32(const actorlm_quant_part* part, int64_t in_features,
                                       const int64_t* rows, int64_t num_rows, float* out) {
  dequantize_rows(*part, in_features, rows, num_rows, out);
}
void actorlm_quant_dequantize_rows_bf16(const actorlm_quant_part* part, int64_t in_features,
                                        const int64_t* rows, int64_t num_rows, uint16_t* out) {
  dequantize_rows(*part, in_features, rows, num_rows, out);
}

}  // extern "C"
