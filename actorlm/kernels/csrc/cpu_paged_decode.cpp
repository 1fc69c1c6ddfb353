// Paged attention for decode rows on a CPU: one query token per request, read straight from the
// paged KV cache (no gather into a dense copy, no padding to the batch's longest context).
//
// Work item = (request, KV head): the G query heads that share the KV head walk its context
// block by block with an online softmax (scores, max and sums in fp32), so each K/V row is read
// once for all G heads. Items are split statically over the caller's OpenMP team: this library
// links the libgomp that torch has already loaded (same soname), so it runs on torch's own pool
// instead of a second one that would fight it for the cores.
//
// Built by actorlm/kernels/cpu_decode.py with -O3 -march=native -ffast-math at compile time
// only: the link step leaves out crtfastmath.o, which would set flush-to-zero for the whole
// process. Every value stays finite (the running max starts at -1e30, not -inf), as
// -ffast-math assumes.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "dtype.h"

namespace {

using actorlm::store;
using actorlm::to_float;

constexpr int kMaxGroup = 32;      // query heads per KV head
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlockSize = 256;

template <typename T>
void decode(const T* query, int64_t query_row_stride, const int32_t* rows, const T* k_cache,
            const T* v_cache, const int32_t* block_tables, int max_blocks, const int32_t* seq_lens,
            T* out, int num_requests, int num_heads, int num_kv_heads, int head_dim,
            int block_size, float scale) {
  const int group = num_heads / num_kv_heads;
#pragma omp parallel for schedule(static) collapse(2)
  for (int b = 0; b < num_requests; ++b) {
    for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
      float q[kMaxGroup][kMaxHeadDim], acc[kMaxGroup][kMaxHeadDim];
      float running_max[kMaxGroup], running_sum[kMaxGroup], p[kMaxGroup][kMaxBlockSize];
      const int64_t row = rows ? rows[b] : b;
      for (int g = 0; g < group; ++g) {
        const T* q_row = query + row * query_row_stride + int64_t(kv_head * group + g) * head_dim;
        for (int d = 0; d < head_dim; ++d) {
          q[g][d] = to_float(q_row[d]) * scale;
          acc[g][d] = 0.f;
        }
        running_max[g] = -1e30f;
        running_sum[g] = 0.f;
      }
      const int seq_len = seq_lens[b];
      for (int j = 0; j * block_size < seq_len; ++j) {
        const int64_t block = block_tables[int64_t(b) * max_blocks + j];
        const int n = std::min(block_size, seq_len - j * block_size);
        const int64_t first = (block * block_size * num_kv_heads + kv_head) * head_dim;
        const int64_t step = int64_t(num_kv_heads) * head_dim;  // one position to the next
        for (int t = 0; t < n; ++t) {
          const T* k = k_cache + first + t * step;
          for (int g = 0; g < group; ++g) {
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_dim; ++d) dot += q[g][d] * to_float(k[d]);
            p[g][t] = dot;
          }
        }
        for (int g = 0; g < group; ++g) {  // online softmax over this block's scores
          float block_max = running_max[g];
          for (int t = 0; t < n; ++t) block_max = std::max(block_max, p[g][t]);
          const float rescale = expf(running_max[g] - block_max);
          float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
          for (int t = 0; t < n; ++t) {
            p[g][t] = expf(p[g][t] - block_max);
            block_sum += p[g][t];
          }
          running_sum[g] = running_sum[g] * rescale + block_sum;
          running_max[g] = block_max;
#pragma omp simd
          for (int d = 0; d < head_dim; ++d) acc[g][d] *= rescale;
        }
        for (int t = 0; t < n; ++t) {
          const T* v = v_cache + first + t * step;
          for (int g = 0; g < group; ++g) {
            const float weight = p[g][t];
#pragma omp simd
            for (int d = 0; d < head_dim; ++d) acc[g][d] += weight * to_float(v[d]);
          }
        }
      }
      for (int g = 0; g < group; ++g) {
        T* o = out + (row * num_heads + kv_head * group + g) * head_dim;
        const float inv_sum = 1.f / running_sum[g];
        for (int d = 0; d < head_dim; ++d) store(acc[g][d] * inv_sum, o + d);
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

#define ACTORLM_DECODE(NAME, T)                                                                   \
  void NAME(const T* query, int64_t query_row_stride, const int32_t* rows, const T* k_cache,    \
            const T* v_cache, const int32_t* block_tables, int max_blocks,                     \
            const int32_t* seq_lens, T* out, int num_requests, int num_heads, int num_kv_heads, \
            int head_dim, int block_size, float scale) {                                       \
    decode(query, query_row_stride, rows, k_cache, v_cache, block_tables, max_blocks, seq_lens, \
           out, num_requests, num_heads, num_kv_heads, head_dim, block_size, scale);           \
  }

ACTORLM_DECODE(actorlm_decode_f32, float)
ACTORLM_DECODE(actorlm_decode_bf16, uint16_t)

}  // extern "C"
