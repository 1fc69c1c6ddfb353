// Paged attention for decode rows on a CPU: one query token per request, read straight from the
// paged KV cache (no gather into a dense copy, no padding to the batch's longest context).
//
// Work item = (request, KV head, span of its context): the G query heads that share the KV head
// walk the span block by block with an online softmax (scores, max and sums in fp32), so each
// K/V row is read once for all G heads. A long context is cut into spans (flash-decoding), so
// one long request is spread over every thread instead of holding one while the others idle;
// each item leaves its unnormalised sums, max and total, and a second pass merges a request's
// spans. Items go to the caller's OpenMP team: this library links the libgomp that torch has
// already loaded (same soname), so it runs on torch's own pool instead of a second one that
// would fight it for the cores.
//
// The caches hold the query's dtype, or an FP8 format (--kv-cache-dtype), whose values are
// widened to fp32 as they are loaded.
//
// A sliding window starts a request at max(0, seq_len - window): no block before it is read
// (the allocator frees them; their table entries may name any block), nor the positions
// before it in its block. A cap (softcap * tanh(s / softcap)) bends the scores before softmax.
//
// Built by actorlm/kernels/cpu/native.py with -O3 -march=native -ffast-math at compile time
// only: the link step leaves out crtfastmath.o, which would set flush-to-zero for the whole
// process. Every value stays finite (the running max starts at -1e30, not -inf), as
// -ffast-math assumes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>

#include <omp.h>

#include "actorlm_abi.h"
#include "dtype.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using actorlm::store;
using actorlm::to_float;

constexpr int kMaxGroup = 32;      // query heads per KV head
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlockSize = 256;
constexpr int kMinSpan = 256;  // positions: shorter spans would cost more to merge than they save

// What an item leaves for the merge, per query head: the unnormalised weighted sum of V rows
// (head_dim floats), then the running max and the running sum of the softmax.
inline int64_t partial_size(int head_dim) { return head_dim + 2; }

// The online softmax over one block's n scores (in place: exp(score - new max)); returns the
// factor that rescales what was accumulated before this block.
inline float softmax_block(float* p, int n, float& running_max, float& running_sum) {
  float block_max = running_max;
  for (int t = 0; t < n; ++t) block_max = std::max(block_max, p[t]);
  const float rescale = expf(running_max - block_max);
  float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
  for (int t = 0; t < n; ++t) {
    p[t] = expf(p[t] - block_max);
    block_sum += p[t];
  }
  running_sum = running_sum * rescale + block_sum;
  running_max = block_max;
  return rescale;
}

inline void cap_scores(float* p, int n, float softcap) {  // where the layer caps them
  if (softcap <= 0.f) return;
  const float inv_softcap = 1.f / softcap;
#pragma omp simd
  for (int t = 0; t < n; ++t) p[t] = softcap * tanhf(p[t] * inv_softcap);
}

// Every K and V row of the block that starts at `first` into the cache, while the one before it
// is attended: blocks are scattered, so no hardware prefetcher guesses the next.
template <typename T>
inline void prefetch_rows(const T* k_cache, const T* v_cache, int64_t first,
                          int64_t position_stride, int block_size, int dim) {
  for (int t = 0; t < block_size; ++t) {
    const char* k = reinterpret_cast<const char*>(k_cache + first + t * position_stride);
    const char* v = reinterpret_cast<const char*>(v_cache + first + t * position_stride);
    for (int line = 0; line < int(dim * sizeof(T)); line += 64) {
      __builtin_prefetch(k + line);
      __builtin_prefetch(v + line);
    }
  }
}

// Block j of an item over positions [begin, end): the offset in the cache of its first K/V row
// the item reads (at `begin` in the item's first block), with the number of them in `n`; the
// next block, if the item reads one, is prefetched.
template <typename T>
inline int64_t enter_block(const T* k_cache, const T* v_cache, const int32_t* block_table, int j,
                           int begin, int end, int block_size, int64_t first_position,
                           int64_t position_stride, int dim, int& n) {
  const int64_t block_stride = int64_t(block_size) * position_stride;
  const int skip = std::max(0, begin - j * block_size);
  n = std::min(block_size, end - j * block_size) - skip;
  if ((j + 1) * block_size < end)
    prefetch_rows(k_cache, v_cache, block_table[j + 1] * block_stride + first_position,
                  position_stride, block_size, dim);
  return block_table[j] * block_stride + first_position + skip * position_stride;
}

// One work item: a request's G query heads that share one KV head, over positions
// [begin, end) of its context, into `partial` (G partial_size()s).
// kHeadDim is the head size where it is one of the common ones (then every loop over it has a
// trip count the compiler knows, and is unrolled and vectorised whole), else 0 and head_dim.
template <typename T, typename C, int kHeadDim>
void attend_item(const T* query, const C* k_cache, const C* v_cache, const int32_t* block_table,
                 int begin, int end, int64_t first_position, int64_t position_stride, int group,
                 int head_dim, int block_size, float scale, float softcap, float* partial) {
  const int dim = kHeadDim ? kHeadDim : head_dim;
  alignas(64) float q[kMaxGroup][kMaxHeadDim], acc[kMaxGroup][kMaxHeadDim];
  alignas(64) float p[kMaxGroup][kMaxBlockSize];
  float running_max[kMaxGroup], running_sum[kMaxGroup];
  for (int g = 0; g < group; ++g) {
    for (int d = 0; d < dim; ++d) {
      q[g][d] = to_float(query[g * dim + d]) * scale;
      acc[g][d] = 0.f;
    }
    running_max[g] = -1e30f;
    running_sum[g] = 0.f;
  }
  for (int j = begin / block_size; j * block_size < end; ++j) {
    int n;
    const int64_t first = enter_block(k_cache, v_cache, block_table, j, begin, end, block_size,
                                      first_position, position_stride, dim, n);
    for (int g = 0; g < group; ++g) {  // scores
      for (int t = 0; t < n; ++t) {
        const C* k = k_cache + first + t * position_stride;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < dim; ++d) dot += q[g][d] * to_float(k[d]);
        p[g][t] = dot;
      }
    }
    for (int g = 0; g < group; ++g) {
      cap_scores(p[g], n, softcap);
      const float rescale = softmax_block(p[g], n, running_max[g], running_sum[g]);
      // one head's sum at a time: with a known head size it stays in registers over the block
      alignas(64) float sum[kMaxHeadDim];
#pragma omp simd
      for (int d = 0; d < dim; ++d) sum[d] = acc[g][d] * rescale;
      for (int t = 0; t < n; ++t) {
        const C* v = v_cache + first + t * position_stride;
        const float weight = p[g][t];
#pragma omp simd
        for (int d = 0; d < dim; ++d) sum[d] += weight * to_float(v[d]);
      }
#pragma omp simd
      for (int d = 0; d < dim; ++d) acc[g][d] = sum[d];
    }
  }
  for (int g = 0; g < group; ++g) {
    float* mine = partial + g * partial_size(dim);
    for (int d = 0; d < dim; ++d) mine[d] = acc[g][d];
    mine[dim] = running_max[g];
    mine[dim + 1] = running_sum[g];
  }
}

#ifdef __AVX512F__
// The same item with AVX-512 registers, for a head size of 16 * kVectors and kGroup query heads
// per KV head known at compile time: the G query rows and their running sums stay in
// registers, and each K and V row is loaded (and widened from bf16) once for all G heads.
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const actorlm::E5M2* x) { return actorlm::widen16(x); }  // an FP8 cache's
inline __m512 load16(const actorlm::E4M3* x) { return actorlm::widen16(x); }

// Lane t of the result is the sum of the 16 lanes of v[t]: a transpose folded into the adds,
// 45 instructions where 16 separate horizontal sums would take ~130.
inline __m512 sum_each(const __m512 v[16]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of v4i .. v4i+3
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // the four 128-bit lanes of each quad summed, quad i into lane i (shuffles of whole lanes)
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], kEven),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], kOdd));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], kEven),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, kEven), _mm512_shuffle_f32x4(low, high, kOdd));
}

template <typename T, typename C, int kVectors, int kGroup>
void attend_item_avx512(const T* query, const C* k_cache, const C* v_cache,
                        const int32_t* block_table, int begin, int end, int64_t first_position,
                        int64_t position_stride, int, int, int block_size, float scale,
                        float softcap, float* partial) {
  constexpr int dim = 16 * kVectors;
  __m512 q[kGroup][kVectors], acc[kGroup][kVectors];
  float running_max[kGroup], running_sum[kGroup];
  alignas(64) float p[kGroup][kMaxBlockSize];
  for (int g = 0; g < kGroup; ++g) {
    for (int i = 0; i < kVectors; ++i) {
      q[g][i] = _mm512_mul_ps(load16(query + g * dim + 16 * i), _mm512_set1_ps(scale));
      acc[g][i] = _mm512_setzero_ps();
    }
    running_max[g] = -1e30f;
    running_sum[g] = 0.f;
  }
  for (int j = begin / block_size; j * block_size < end; ++j) {
    int n;
    const int64_t first = enter_block(k_cache, v_cache, block_table, j, begin, end, block_size,
                                      first_position, position_stride, dim, n);
    for (int t0 = 0; t0 < n; t0 += 16) {  // scores, sixteen positions at a time
      __m512 dots[kGroup][16];
      for (int t = 0; t < 16; ++t) {
        if (t0 + t >= n) {
          for (int g = 0; g < kGroup; ++g) dots[g][t] = _mm512_setzero_ps();
          continue;
        }
        const C* k_row = k_cache + first + (t0 + t) * position_stride;
        __m512 k[kVectors];
        for (int i = 0; i < kVectors; ++i) k[i] = load16(k_row + 16 * i);
        for (int g = 0; g < kGroup; ++g) {
          dots[g][t] = _mm512_mul_ps(q[g][0], k[0]);
          for (int i = 1; i < kVectors; ++i) dots[g][t] = _mm512_fmadd_ps(q[g][i], k[i], dots[g][t]);
        }
      }
      for (int g = 0; g < kGroup; ++g) _mm512_store_ps(p[g] + t0, sum_each(dots[g]));
    }
    for (int g = 0; g < kGroup; ++g) {
      cap_scores(p[g], n, softcap);
      const float rescale = softmax_block(p[g], n, running_max[g], running_sum[g]);
      for (int i = 0; i < kVectors; ++i) acc[g][i] = _mm512_mul_ps(acc[g][i], _mm512_set1_ps(rescale));
    }
    for (int t = 0; t < n; ++t) {
      const C* v_row = v_cache + first + t * position_stride;
      __m512 v[kVectors];
      for (int i = 0; i < kVectors; ++i) v[i] = load16(v_row + 16 * i);
      for (int g = 0; g < kGroup; ++g) {
        const __m512 weight = _mm512_set1_ps(p[g][t]);
        for (int i = 0; i < kVectors; ++i) acc[g][i] = _mm512_fmadd_ps(weight, v[i], acc[g][i]);
      }
    }
  }
  for (int g = 0; g < kGroup; ++g) {
    float* mine = partial + g * partial_size(dim);
    for (int i = 0; i < kVectors; ++i) _mm512_storeu_ps(mine + 16 * i, acc[g][i]);
    mine[dim] = running_max[g];
    mine[dim + 1] = running_sum[g];
  }
}
#endif

template <typename T, typename C>
using Item = void (*)(const T*, const C*, const C*, const int32_t*, int, int, int64_t, int64_t,
                      int, int, int, float, float, float*);

#ifdef __AVX512F__
template <typename T, typename C, int kVectors, int... kGroups>
Item<T, C> pick_avx512(int group, std::integer_sequence<int, kGroups...>) {
  Item<T, C> item = nullptr;
  ((group == kGroups + 1 ? (item = attend_item_avx512<T, C, kVectors, kGroups + 1>, 0) : 0), ...);
  return item;
}
#endif

// The fastest item this build has for the shape.
template <typename T, typename C>
Item<T, C> pick_item(int head_dim, int group) {
  Item<T, C> item = nullptr;
#ifdef __AVX512F__
  constexpr auto groups = std::make_integer_sequence<int, 8>();  // 1..8 query heads a KV head
  switch (head_dim) {  // the head sizes of the models served, and of small test models
    case 16: item = pick_avx512<T, C, 1>(group, groups); break;
    case 32: item = pick_avx512<T, C, 2>(group, groups); break;
    case 64: item = pick_avx512<T, C, 4>(group, groups); break;
    case 128: item = pick_avx512<T, C, 8>(group, groups); break;
  }
#endif
  if (item) return item;
  return head_dim == 64    ? attend_item<T, C, 64>
         : head_dim == 128 ? attend_item<T, C, 128>
                           : attend_item<T, C, 0>;
}

// out = the softmax-weighted sum over every span of one query head: each span's sums rescaled
// from its own max to the common one.
template <typename T>
void merge_spans(const float* partials, int num_spans, int64_t span_stride, int dim, T* out) {
  float max = -1e30f;
  for (int s = 0; s < num_spans; ++s) max = std::max(max, partials[s * span_stride + dim]);
  alignas(64) float sum[kMaxHeadDim] = {};
  float total = 0.f;
  for (int s = 0; s < num_spans; ++s) {
    const float* span = partials + s * span_stride;
    const float weight = expf(span[dim] - max);
    total += span[dim + 1] * weight;
#pragma omp simd
    for (int d = 0; d < dim; ++d) sum[d] += span[d] * weight;
  }
  const float inv_total = 1.f / total;
  for (int d = 0; d < dim; ++d) store(sum[d] * inv_total, out + d);
}

template <typename T, typename C>
void decode(const T* query, int64_t query_row_stride, const int32_t* rows, const C* k_cache,
            const C* v_cache, const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
            T* out, int num_requests, int num_heads, int num_kv_heads, int head_dim,
            int block_size, float scale, int window, float softcap) {
  const int group = num_heads / num_kv_heads;
  const auto item = pick_item<T, C>(head_dim, group);
  // request b reads positions [first[b], seq_lens[b]), in spans from the start of first[b]'s
  // block (so that every span but its first starts on a block boundary)
  std::unique_ptr<int[]> first(new int[num_requests]);
  int64_t total = 0;
  for (int b = 0; b < num_requests; ++b) {
    first[b] = window > 0 ? std::max(0, seq_lens[b] - window) : 0;
    total += seq_lens[b] - first[b];
  }
  auto base = [&](int b) { return first[b] / block_size * block_size; };
  // spans of a quarter of a thread's share of the work (never under kMinSpan, in whole blocks):
  // short contexts stay whole, a long one is spread over the team
  const int64_t share = total * num_kv_heads / (4 * omp_get_max_threads());
  const int64_t span = (std::max<int64_t>(kMinSpan, share) + block_size - 1) / block_size * block_size;
  std::unique_ptr<int[]> first_span(new int[num_requests + 1]);  // request b: spans [first, next)
  first_span[0] = 0;
  for (int b = 0; b < num_requests; ++b)
    first_span[b + 1] = first_span[b] + int((seq_lens[b] - base(b) + span - 1) / span);
  const int num_spans = first_span[num_requests];
  std::unique_ptr<int[]> span_request(new int[num_spans]);
  for (int b = 0; b < num_requests; ++b)
    for (int s = first_span[b]; s < first_span[b + 1]; ++s) span_request[s] = b;
  // partials[span][kv_head][g], for requests of more than one span
  const int64_t head_stride = partial_size(head_dim), span_stride = num_heads * head_stride;
  const bool split = num_spans > num_requests;
  std::unique_ptr<float[]> partials(split ? new float[num_spans * span_stride] : nullptr);
  auto attend_span = [&](int64_t i) {
    const int s = int(i / num_kv_heads), kv_head = int(i % num_kv_heads), b = span_request[s];
    const int64_t row = rows ? rows[b] : b;
    const int64_t first_head = int64_t(kv_head) * group;
    const int64_t span_start = base(b) + (s - first_span[b]) * span;
    const int begin = int(std::max<int64_t>(first[b], span_start));
    const bool whole = first_span[b + 1] - first_span[b] == 1;
    alignas(64) float own[kMaxGroup * (kMaxHeadDim + 2)];  // a whole context's, merged at once
    float* partial = whole ? own : partials.get() + s * span_stride + first_head * head_stride;
    item(query + row * query_row_stride + first_head * head_dim, k_cache, v_cache,
         block_tables + int64_t(b) * max_blocks, begin,
         int(std::min<int64_t>(seq_lens[b], span_start + span)), int64_t(kv_head) * head_dim,
         int64_t(num_kv_heads) * head_dim, group, head_dim, block_size, scale, softcap, partial);
    for (int g = 0; whole && g < group; ++g) {  // normalised by its own sum
      const float* mine = own + g * head_stride;
      T* o = out + (row * num_heads + first_head + g) * head_dim;
      const float inv_sum = 1.f / mine[head_dim + 1];
      for (int d = 0; d < head_dim; ++d) store(mine[d] * inv_sum, o + d);
    }
  };
  const int64_t num_items = int64_t(num_spans) * num_kv_heads;
  if (!split) {  // no context past a quarter of a thread's share: static shares balance
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < num_items; ++i) attend_span(i);
    return;
  }
#pragma omp parallel
  {
#pragma omp for schedule(dynamic, 1)  // spans and short contexts: unequal lengths
    for (int64_t i = 0; i < num_items; ++i) attend_span(i);
#pragma omp for schedule(static) collapse(2)
    for (int b = 0; b < num_requests; ++b) {
      for (int head = 0; head < num_heads; ++head) {
        if (first_span[b + 1] - first_span[b] == 1) continue;  // written by its item
        const int64_t row = rows ? rows[b] : b;
        merge_spans(partials.get() + first_span[b] * span_stride + head * head_stride,
                    first_span[b + 1] - first_span[b], span_stride, head_dim,
                    out + (row * num_heads + head) * head_dim);
      }
    }
  }
}

}  // namespace

extern "C" {

int actorlm_decode_limits(int* max_group, int* max_head_dim, int* max_block_size) {
  *max_group = kMaxGroup;
  *max_head_dim = kMaxHeadDim;
  *max_block_size = kMaxBlockSize;
  return 0;
}

// the caches' values as the ABI passes them (STORED: an FP8 cache's bytes) and as read (C)
#define ACTORLM_DECODE(NAME, T, STORED, C)                                                      \
  void NAME(const T* query, int64_t query_row_stride, const int32_t* rows,                     \
            const STORED* k_cache, const STORED* v_cache, const int32_t* block_tables,         \
            int max_blocks, const int32_t* seq_lens, T* out, int num_requests, int num_heads,  \
            int num_kv_heads, int head_dim, int block_size, float scale, int window,           \
            float softcap) {                                                                   \
    decode(query, query_row_stride, rows, reinterpret_cast<const C*>(k_cache),                 \
           reinterpret_cast<const C*>(v_cache), block_tables, max_blocks, seq_lens, out,       \
           num_requests, num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap); \
  }

ACTORLM_DECODE(actorlm_decode_f32, float, float, float)
ACTORLM_DECODE(actorlm_decode_bf16, uint16_t, uint16_t, uint16_t)
ACTORLM_DECODE(actorlm_decode_f32_e4m3, float, uint8_t, actorlm::E4M3)
ACTORLM_DECODE(actorlm_decode_bf16_e4m3, uint16_t, uint8_t, actorlm::E4M3)
ACTORLM_DECODE(actorlm_decode_f32_e5m2, float, uint8_t, actorlm::E5M2)
ACTORLM_DECODE(actorlm_decode_bf16_e5m2, uint16_t, uint8_t, actorlm::E5M2)

}  // extern "C"
