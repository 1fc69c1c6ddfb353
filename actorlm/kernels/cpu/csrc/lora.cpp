// LoRA deltas of a batch that mixes adapters, row by row (kernels/lora.py is the torch twin):
// each row with a slot gets x @ A[s].T @ B[s] added to its output, where A is [rank, in] and B
// [rank, out] (transposed), both in the model's dtype, the adapter's scale folded into B.
//
// Rows are grouped by slot, up to four at a time, so each A and B element read serves up to
// four rows from registers. The shrink is rank dot products along `in`, four of A's rows at
// once (sixteen independent sums for four rows: a lone sum waits on its own adds); the expand
// is rank axpys along the outputs, one part of a merged layer at a time (q, k, v; gate, up:
// each part owns rank / parts columns of the rank and its own output rows, and B is zero
// elsewhere, so the zero blocks are never read). Rounding follows torch's two matmuls and the
// add: the shrink's result and the expand's are each rounded to the dtype, then the sum with y.
//
// The work splits into items, a block of rows through one part each, which need no barrier
// between them; a lone block (one request's rows) splits its shrink over A's rows and, after
// a barrier, its expand over equal shares of the outputs, whichever parts they fall in. One
// OpenMP region a call, and none where the work does not pay for waking the team. Each
// thread fetches the bytes it is about to read a few kilobytes ahead of its loads
// (ReadAhead, on both paths): in a one-row SmolLM2 decode step the adapter's 9.8 MB (bf16)
// come from memory in short runs, a few dozen kilobytes a call, which the hardware
// prefetchers do not follow.
//
// Two paths: AVX-512 (its bf16 dot products where the CPU has them), and a portable one, which
// a CPU without AVX-512 runs and a test can choose (actorlm_lora_set_isa).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "actorlm_abi.h"
#include "dtype.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ACTORLM_LORA_AVX512 1
#endif

namespace {

using actorlm::rounded;
using actorlm::store;
using actorlm::to_float;

enum Isa { kPortable = 0, kAvx512 = 1 };
#ifdef ACTORLM_LORA_AVX512
constexpr int kBestIsa = kAvx512;
#else
constexpr int kBestIsa = kPortable;
#endif
std::atomic<int> g_isa{kBestIsa};

constexpr int kRowsPerBlock = 4;
constexpr int kRanksPerItem = 4;  // A's rows a shrink reads at once
constexpr int64_t kOutputsPerChunk = 512;
// multiply-adds of a call worth splitting over the team: a lone decode row of a small layer
// takes a few microseconds alone, about what waking the team and joining it again cost
constexpr int64_t kParallelFrom = 32768;

struct Block {  // up to kRowsPerBlock rows of one slot: order[first, first + count)
  int32_t slot, first, count;
};

struct Chunk {  // outputs [begin, end) of one part, which owns rank columns [k0, k1)
  int64_t begin, end;
  int32_t k0, k1;
};

// The bytes a thread's share of a call reads, in the order its loops read them, fetched into
// L2 kAheadBytes before the loads get there. A call's runs are short (a pass over four rows
// of A, a chunk's rows of B: a kilobyte or two each), too short for the hardware prefetchers
// to get going, and between tokens the base layers' weights push A and B out of the caches:
// without this, the loads wait on memory a few lines at a time.
class ReadAhead {
 public:
  // `rows` runs of `bytes` each, `stride` bytes apart, read after the runs added before
  void add(const void* first, int64_t bytes, int64_t stride, int rows) {
    if (num_ < kMaxSpans && rows > 0 && bytes > 0)
      spans_[num_++] = {static_cast<const char*>(first), bytes, stride, rows};
  }

  void start() { read(kAheadBytes); }

  // the loops have read `bytes` more: fetch as many more, ahead of them
  inline void read(int64_t bytes) {
    for (owed_ += bytes; owed_ >= kLine && span_ < num_; owed_ -= kLine) {
      const Span& s = spans_[span_];
      __builtin_prefetch(s.first + row_ * s.stride + offset_, 0, 2);
      if ((offset_ += kLine) >= s.bytes) {
        offset_ = 0;
        if (++row_ == s.rows) row_ = 0, ++span_;
      }
    }
  }

 private:
  static constexpr int kMaxSpans = 8;  // runs beyond (a very wide layer's chunks) go unfetched
  static constexpr int64_t kLine = 64, kAheadBytes = 4096;  // (4 KB: the best of 2-16 measured)
  struct Span {
    const char* first;
    int64_t bytes, stride;
    int rows;
  };
  Span spans_[kMaxSpans];
  int num_ = 0, span_ = 0, row_ = 0;
  int64_t offset_ = 0, owed_ = 0;
};

// y[o] = y[o] + round(delta[o]), rounded, for o < width
template <typename T>
inline void add_rounded(const float* delta, T* y, int64_t width) {
  for (int64_t o = 0; o < width; ++o) store(to_float(y[o]) + rounded(delta[o], y), y + o);
}

// --- portable ------------------------------------------------------------------------------

// t[j][k] = dot(xs[j], A[k]) over `in`, rounded, for the block's N rows and A's rows
// [k0, k0 + kc) (named sums: the compiler vectorises a reduction into a scalar, not into an
// array's element)
template <int N, typename T>
void shrink(const T* a, int64_t in, const float* const* xs, float* t, int rank, int k0,
            int kc, ReadAhead& ahead) {
  const float *x0 = xs[0], *x1 = xs[N > 1 ? 1 : 0], *x2 = xs[N > 2 ? 2 : 0],
              *x3 = xs[N > 3 ? 3 : 0];
  for (int k = k0; k < k0 + kc; ++k) {
    ahead.read(in * int64_t(sizeof(T)));  // (a row at a time: the loop below is the compiler's)
    const T* ak = a + int64_t(k) * in;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t i = 0; i < in; ++i) {
      const float w = to_float(ak[i]);
      s0 += w * x0[i];
      if (N > 1) s1 += w * x1[i];
      if (N > 2) s2 += w * x2[i];
      if (N > 3) s3 += w * x3[i];
    }
    const float sums[4] = {s0, s1, s2, s3};
    for (int j = 0; j < N; ++j)
      t[j * rank + k] = rounded(sums[j], static_cast<const T*>(nullptr));
  }
}

// y rows += round(t @ B[k0:k1, begin:end]) for the block's N rows
template <int N, typename T>
void expand(const T* b, int64_t out, const Chunk& c, const float* t, int rank, T* const* ys,
            ReadAhead& ahead) {
  float acc[N][kOutputsPerChunk] = {};
  const int64_t width = c.end - c.begin;
  for (int k = c.k0; k < c.k1; ++k) {
    ahead.read(width * int64_t(sizeof(T)));
    const T* bk = b + int64_t(k) * out + c.begin;
    for (int j = 0; j < N; ++j) {
      const float tk = t[j * rank + k];
#pragma omp simd
      for (int64_t o = 0; o < width; ++o) acc[j][o] += tk * to_float(bk[o]);
    }
  }
  for (int j = 0; j < N; ++j) add_rounded(acc[j], ys[j] + c.begin, width);
}

// --- AVX-512 -------------------------------------------------------------------------------

#ifdef ACTORLM_LORA_AVX512

inline __mmask16 mask16(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {  // bf16 widened: its bits, shifted up
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// a shrink's partial sums: KC of A's rows times N rows, a register each
template <int N, int KC>
struct Sums {
  __m512 v[KC][N];

  Sums() {
    for (int kk = 0; kk < KC; ++kk)
      for (int j = 0; j < N; ++j) v[kk][j] = _mm512_setzero_ps();
  }

  // t[j][k0 + kk] = each sum, rounded to T
  template <typename T>
  void store(float* t, int rank, int k0) const {
    for (int kk = 0; kk < KC; ++kk)
      for (int j = 0; j < N; ++j)
        t[j * rank + k0 + kk] =
            rounded(_mm512_reduce_add_ps(v[kk][j]), static_cast<const T*>(nullptr));
  }
};

// the portable shrink's results, sixteen of `in` at a time: KC <= 4 of A's rows times N rows
// in registers, x read once for all of A's rows
template <int N, int KC, typename T>
void shrink_avx512(const T* a, int64_t in, const float* const* xs, float* t, int rank,
                   int k0, ReadAhead& ahead) {
  Sums<N, KC> sums;
  auto& acc = sums.v;
  for (int64_t i = 0; i < in; i += 16) {
    ahead.read(KC * 16 * sizeof(T));
    const __mmask16 m = mask16(in - i);
    __m512 x[N];
    for (int j = 0; j < N; ++j) x[j] = _mm512_maskz_loadu_ps(m, xs[j] + i);
    for (int kk = 0; kk < KC; ++kk) {
      const __m512 w = load16(a + int64_t(k0 + kk) * in + i, m);
      for (int j = 0; j < N; ++j) acc[kk][j] = _mm512_fmadd_ps(w, x[j], acc[kk][j]);
    }
  }
  sums.template store<T>(t, rank, k0);
}

#ifdef __AVX512BF16__
// bf16 rows against bf16 A, 32 products a step summed in pairs into fp32 (vdpbf16ps)
template <int N, int KC>
void shrink_bf16(const uint16_t* a, int64_t in, const uint16_t* const* xs, float* t, int rank,
                 int k0, ReadAhead& ahead) {
  Sums<N, KC> sums;
  auto& acc = sums.v;
  for (int64_t i = 0; i < in; i += 32) {
    ahead.read(KC * 64);
    const __mmask32 m = in - i >= 32 ? __mmask32(0xFFFFFFFF) : __mmask32((1u << (in - i)) - 1);
    __m512bh x[N];
    for (int j = 0; j < N; ++j) x[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, xs[j] + i);
    for (int kk = 0; kk < KC; ++kk) {
      const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(m, a + int64_t(k0 + kk) * in + i);
      for (int j = 0; j < N; ++j) acc[kk][j] = _mm512_dpbf16_ps(acc[kk][j], w, x[j]);
    }
  }
  sums.template store<uint16_t>(t, rank, k0);
}
#endif

// the portable expand's results: four of B's rows at a time, each read along the chunk's
// outputs (four sequential streams; a chunk's rows read in parallel would be sixteen or more,
// each a few lines long, which the prefetchers do not follow), into sums kept in L1
template <int N, typename T>
void expand_avx512(const T* b, int64_t out, const Chunk& c, const float* t, int rank,
                   T* const* ys, ReadAhead& ahead) {
  const int64_t width = c.end - c.begin;
  alignas(64) float acc[N][kOutputsPerChunk];
  for (int k = c.k0; k < c.k1; k += 4) {
    const int kc = std::min(4, c.k1 - k);
    const T* bk[4];
    __m512 tk[4][N];
    for (int kk = 0; kk < 4; ++kk) {  // a missing row of B: the last one again, times zero
      bk[kk] = b + int64_t(k + std::min(kk, kc - 1)) * out + c.begin;
      for (int j = 0; j < N; ++j)
        tk[kk][j] = _mm512_set1_ps(kk < kc ? t[j * rank + k + kk] : 0.f);
    }
    for (int64_t o = 0; o < width; o += 16) {
      ahead.read(kc * 16 * sizeof(T));
      const __mmask16 m = mask16(width - o);
      const __m512 w0 = load16(bk[0] + o, m), w1 = load16(bk[1] + o, m),
                   w2 = load16(bk[2] + o, m), w3 = load16(bk[3] + o, m);
      for (int j = 0; j < N; ++j) {
        __m512 sum = k == c.k0 ? _mm512_setzero_ps() : _mm512_load_ps(acc[j] + o);
        sum = _mm512_fmadd_ps(tk[0][j], w0, sum);
        sum = _mm512_fmadd_ps(tk[1][j], w1, sum);
        sum = _mm512_fmadd_ps(tk[2][j], w2, sum);
        sum = _mm512_fmadd_ps(tk[3][j], w3, sum);
        _mm512_store_ps(acc[j] + o, sum);
      }
    }
  }
  for (int j = 0; j < N; ++j) add_rounded(acc[j], ys[j] + c.begin, width);
}

#endif  // ACTORLM_LORA_AVX512

// --- a call ----------------------------------------------------------------------------------

// f(N, KC) with N rows (1..4) and KC of A's rows (1..4) as compile-time constants
template <typename F>
void with_counts(int num_rows, int num_ranks, F&& f) {
  auto with_ranks = [&](auto rows) {
    switch (num_ranks) {
      case 4: return f(rows, std::integral_constant<int, 4>{});
      case 3: return f(rows, std::integral_constant<int, 3>{});
      case 2: return f(rows, std::integral_constant<int, 2>{});
      default: return f(rows, std::integral_constant<int, 1>{});
    }
  };
  switch (num_rows) {
    case 4: return with_ranks(std::integral_constant<int, 4>{});
    case 3: return with_ranks(std::integral_constant<int, 3>{});
    case 2: return with_ranks(std::integral_constant<int, 2>{});
    default: return with_ranks(std::integral_constant<int, 1>{});
  }
}

// one block's shrink of A's rows [k0, k0 + kc) on the chosen path
template <typename T>
void shrink_block(int isa, int count, const T* as, int64_t in, const float* const* xf,
                  const T* const* xt, float* ts, int rank, int k0, int kc, ReadAhead& ahead) {
  with_counts(count, kc, [&](auto rows, auto ranks) {
    constexpr int N = decltype(rows)::value, KC = decltype(ranks)::value;
#ifdef ACTORLM_LORA_AVX512
    if (isa == kAvx512) {
#ifdef __AVX512BF16__
      if constexpr (sizeof(T) == 2) return shrink_bf16<N, KC>(as, in, xt, ts, rank, k0, ahead);
#endif
      return shrink_avx512<N, KC>(as, in, xf, ts, rank, k0, ahead);
    }
#endif
    (void)isa, (void)xt;
    shrink<N>(as, in, xf, ts, rank, k0, KC, ahead);
  });
}

// one block's expand of a chunk on the chosen path
template <typename T>
void expand_block(int isa, int count, const T* bs, int64_t out, const Chunk& c,
                  const float* ts, int rank, T* const* ys, ReadAhead& ahead) {
  with_counts(count, 1, [&](auto rows, auto) {
    constexpr int N = decltype(rows)::value;
#ifdef ACTORLM_LORA_AVX512
    if (isa == kAvx512) return expand_avx512<N>(bs, out, c, ts, rank, ys, ahead);
#endif
    (void)isa;
    expand<N>(bs, out, c, ts, rank, ys, ahead);
  });
}

// whether the shrink reads the rows in T as they are (bf16 dot products) rather than widened
template <typename T>
bool reads_rows_as_they_are(int isa) {
#if defined(ACTORLM_LORA_AVX512) && defined(__AVX512BF16__)
  return sizeof(T) == 2 && isa == kAvx512;
#else
  (void)isa;
  return false;
#endif
}

// A call's bookkeeping, kept by its thread from call to call: a decode step makes four calls
// a layer, and their allocations were a tenth of a one-row step's LoRA time
template <typename T>
struct Scratch {
  std::vector<int32_t> order;  // the rows with a slot, grouped by slot in row order
  std::vector<Block> blocks;
  std::vector<Chunk> chunks;
  std::vector<const T*> xt;  // the rows as they are
  std::vector<const float*> xf;  // the rows in fp32
  std::vector<float> widened, t;  // bf16 rows widened to fp32; the shrink's results
};

struct Range {
  int64_t begin, end;
};

// thread `thread` of `threads`: its contiguous share of `count` items
inline Range share(int64_t count, int thread, int threads) {
  const int64_t base = count / threads, extra = count % threads;
  const int64_t begin = thread * base + std::min<int64_t>(thread, extra);
  return {begin, begin + base + (thread < extra)};
}

// a chunk's rows of B (its part's rank columns), as its expand reads them
template <typename T>
void add_chunk(ReadAhead& ahead, const T* b, int64_t out, const Chunk& c) {
  ahead.add(b + int64_t(c.k0) * out + c.begin, (c.end - c.begin) * int64_t(sizeof(T)),
            out * int64_t(sizeof(T)), c.k1 - c.k0);
}

template <typename T>
void lora_add(const actorlm_lora& l, const T* x, int64_t x_stride, T* y, int64_t y_stride,
              int64_t rows, int64_t in, int64_t out, const int32_t* slots) {
  if (!l.a || !slots || rows <= 0) return;
  const int isa = g_isa.load(std::memory_order_relaxed);
  const int rank = l.rank, parts = std::max(1, int(l.num_parts)), part_rank = rank / parts;
  thread_local Scratch<T> scratch;
  std::vector<int32_t>& order = scratch.order;
  std::vector<Block>& blocks = scratch.blocks;
  std::vector<Chunk>& chunks = scratch.chunks;
  std::vector<const T*>& xt = scratch.xt;
  std::vector<const float*>& xf = scratch.xf;
  std::vector<float>& widened = scratch.widened;
  std::vector<float>& t = scratch.t;
  order.clear(), blocks.clear(), chunks.clear();
  int32_t max_slot = -1;
  for (int64_t r = 0; r < rows; ++r) max_slot = std::max(max_slot, slots[r]);
  for (int32_t s = 0; s <= max_slot; ++s) {
    const int32_t start = int32_t(order.size());
    for (int64_t r = 0; r < rows; ++r)
      if (slots[r] == s) order.push_back(int32_t(r));
    for (int32_t f = start; f < int32_t(order.size()); f += kRowsPerBlock)
      blocks.push_back({s, f, std::min<int32_t>(kRowsPerBlock, int32_t(order.size()) - f)});
  }
  const int64_t n = int64_t(order.size());
  if (n == 0) return;
  int64_t part_begin = 0;
  for (int p = 0; p < parts; ++p) {
    // the part in equal chunks (whole vectors) of at most kOutputsPerChunk: split over a team,
    // 576 outputs as 512 and 64 would leave one of two threads idle most of the time
    const int64_t part_end = parts == 1 ? out : l.part_ends[p], width = part_end - part_begin;
    const int64_t num = (width + kOutputsPerChunk - 1) / kOutputsPerChunk;
    const int64_t size = ((width + num - 1) / num + 15) / 16 * 16;
    for (int64_t o = part_begin; o < part_end; o += size)
      chunks.push_back({o, std::min(part_end, o + size), p * part_rank, (p + 1) * part_rank});
    part_begin = part_end;
  }
  // the rows as the shrink reads them: as they are, or widened to fp32 once (the shrink reads
  // each rank times); and the shrink's results
  xt.resize(n), xf.resize(n);
  for (int64_t i = 0; i < n; ++i) xt[i] = x + order[i] * x_stride;
  if (!reads_rows_as_they_are<T>(isa)) {
    if constexpr (sizeof(T) == 4) {
      for (int64_t i = 0; i < n; ++i) xf[i] = reinterpret_cast<const float*>(xt[i]);
    } else {
      widened.resize(n * in);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t c = 0; c < in; ++c) widened[i * in + c] = to_float(xt[i][c]);
        xf[i] = widened.data() + i * in;
      }
    }
  }
  t.resize(n * rank);
  const T* a = static_cast<const T*>(l.a);
  const T* b = static_cast<const T*>(l.b);
  const int64_t num_blocks = int64_t(blocks.size()), num_chunks = int64_t(chunks.size());
  const int64_t work = n * (rank * in + part_rank * out);
  // (plain pointers into this thread's scratch: the team's threads have scratches of their own)
  const Block* const block_list = blocks.data();
  const Chunk* const chunk_list = chunks.data();
  const int32_t* const row_order = order.data();
  const float* const* const rows_f = xf.data();
  const T* const* const rows_t = xt.data();
  float* const sums = t.data();
  // one item: a block's delta through one part (its own columns of the rank, its own rows of
  // B), shrink then expand, so items need no barrier between them
  auto item = [&](int64_t bi, int p) {
    const Block& blk = block_list[bi];
    const T* as = a + int64_t(blk.slot) * rank * in;
    const T* bs = b + int64_t(blk.slot) * rank * out;
    const int k0 = p * part_rank, k1 = k0 + part_rank;
    ReadAhead ahead;
    ahead.add(as + int64_t(k0) * in, int64_t(part_rank) * in * sizeof(T), 0, 1);
    for (int64_t ci = 0; ci < num_chunks; ++ci)
      if (chunk_list[ci].k0 == k0) add_chunk(ahead, bs, out, chunk_list[ci]);
    ahead.start();
    float* ts = sums + int64_t(blk.first) * rank;
    for (int k = k0; k < k1; k += kRanksPerItem)
      shrink_block(isa, blk.count, as, in, rows_f + blk.first, rows_t + blk.first, ts, rank, k,
                   std::min(kRanksPerItem, k1 - k), ahead);
    T* ys[kRowsPerBlock];
    for (int j = 0; j < blk.count; ++j) ys[j] = y + row_order[blk.first + j] * y_stride;
    for (int64_t ci = 0; ci < num_chunks; ++ci)
      if (chunk_list[ci].k0 == k0)
        expand_block(isa, blk.count, bs, out, chunk_list[ci], ts, rank, ys, ahead);
  };
  const int64_t num_items = num_blocks * parts;
  if (work < kParallelFrom) {  // (not even a team of one: its barriers cost a microsecond)
    for (int64_t i = 0; i < num_items; ++i) item(i / parts, int(i % parts));
    return;
  }
  if (num_blocks >= 2) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) item(i / parts, int(i % parts));
    return;
  }
  // one block (a lone request's rows): each thread's share of the shrink (A's rows, all
  // parts'), then, after the barrier, its share of the expand: an equal share of the outputs,
  // whichever parts they fall in (by parts, q beside k and v would leave a thread idle)
  const Block& blk = block_list[0];
  const T* as = a + int64_t(blk.slot) * rank * in;
  const T* bs = b + int64_t(blk.slot) * rank * out;
  T* ys[kRowsPerBlock];
  for (int j = 0; j < blk.count; ++j) ys[j] = y + row_order[blk.first + j] * y_stride;
  const int64_t num_k_items = (rank + kRanksPerItem - 1) / kRanksPerItem;
#pragma omp parallel
  {
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    const Range ks = share(num_k_items, thread, threads);
    const Range vs = share((out + 15) / 16, thread, threads);  // vectors of outputs
    const int k_begin = int(ks.begin) * kRanksPerItem;
    const int k_end = std::min(rank, int(ks.end) * kRanksPerItem);
    // f(chunk) for this thread's outputs, cut at the parts' ends and into chunks its sums fit
    auto each_chunk = [&](auto&& f) {
      int64_t part_begin = 0;
      for (int p = 0; p < parts; ++p) {
        const int64_t part_end = parts == 1 ? out : l.part_ends[p];
        const int64_t end = std::min(part_end, vs.end * 16);
        for (int64_t o = std::max(part_begin, vs.begin * 16); o < end; o += kOutputsPerChunk)
          f(Chunk{o, std::min(end, o + kOutputsPerChunk), p * part_rank, (p + 1) * part_rank});
        part_begin = part_end;
      }
    };
    ReadAhead ahead;
    if (k_end > k_begin)
      ahead.add(as + int64_t(k_begin) * in, int64_t(k_end - k_begin) * in * sizeof(T), 0, 1);
    each_chunk([&](const Chunk& c) { add_chunk(ahead, bs, out, c); });
    ahead.start();
    for (int k = k_begin; k < k_end; k += kRanksPerItem)
      shrink_block(isa, blk.count, as, in, rows_f, rows_t, sums, rank, k,
                   std::min(kRanksPerItem, k_end - k), ahead);
#pragma omp barrier
    each_chunk([&](const Chunk& c) {
      expand_block(isa, blk.count, bs, out, c, sums, rank, ys, ahead);
    });
  }
}

}  // namespace

extern "C" {

void actorlm_lora_add_f32(const actorlm_lora* lora, const float* x, int64_t x_stride, float* y,
                          int64_t y_stride, int64_t rows, int64_t in_features,
                          int64_t out_features, const int32_t* slots) {
  lora_add(*lora, x, x_stride, y, y_stride, rows, in_features, out_features, slots);
}
void actorlm_lora_add_bf16(const actorlm_lora* lora, const uint16_t* x, int64_t x_stride,
                           uint16_t* y, int64_t y_stride, int64_t rows, int64_t in_features,
                           int64_t out_features, const int32_t* slots) {
  lora_add(*lora, x, x_stride, y, y_stride, rows, in_features, out_features, slots);
}
int actorlm_lora_isa() { return g_isa.load(); }
int actorlm_lora_set_isa(int isa) {
  if (isa < kPortable || isa > kBestIsa) return -1;
  g_isa.store(isa);
  return isa;
}

}  // extern "C"
