// Routed experts of a mixture-of-experts layer on the panel GEMM (linear.cpp): fp32, and bf16
// where the CPU has avx512_bf16.
//
// Each expert's gate/up [2I, H] and down [H, I] are packed once, as a linear layer's weight is
// (actorlm_linear_pack), all experts of a projection in one buffer, `*_stride` values apart.
// A call groups its (row, expert) slots by expert and runs each expert that has rows once over
// all of them: a decode row reads only its top_k experts' weights, each GEMM parallel over
// output columns inside actorlm_linear_rowwise (bf16 on AMX tiles where the CPU has them, at
// every row count), so one row reads at the panel GEMM's speed and a batch's few rows an
// expert cost about what one does; a prefill reads each expert once. The roundings are
// kernels/moe.py's grouped_experts': the projections rounded to the dtype, act(gate) rounded
// before it multiplies up (actorlm_act_and_mul), each expert's output times its fp32 weight
// rounded to the dtype, then the row's slots summed in ascending expert order, each sum
// rounded. The panel GEMM computes a row the same way
// whatever the rows beside it, so a row's result does not depend on the step around it.
// Under expert parallelism the experts are a rank's share of the router's (first_expert on):
// a slot routed to another rank's expert runs nothing and adds zero to its row.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "actorlm_abi.h"
#include "dtype.h"

namespace {

using actorlm::store;
using actorlm::to_float;

template <typename T>
struct Gemm;
template <>
struct Gemm<float> {
  static constexpr auto linear = actorlm_linear_rowwise_f32;
  static constexpr auto act_and_mul = actorlm_act_and_mul_f32;
};
template <>
struct Gemm<uint16_t> {
  static constexpr auto linear = actorlm_linear_rowwise_bf16;
  static constexpr auto act_and_mul = actorlm_act_and_mul_bf16;
};

// Each row's top_k experts by the fp32 softmax of its logits, highest first (ties: the lowest
// index first), their probabilities divided by their sum with `renormalize`.
template <typename T>
void route(const T* logits, int64_t rows, int num_experts, int top_k, int renormalize,
           int64_t* ids, float* weights) {
  std::vector<float> probs(num_experts);
  std::vector<char> taken(num_experts);
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = logits + r * num_experts;
    float top = to_float(row[0]), sum = 0.f;  // (no -inf start: -ffast-math assumes none)
    for (int e = 1; e < num_experts; ++e) top = std::max(top, to_float(row[e]));
    for (int e = 0; e < num_experts; ++e) sum += probs[e] = std::exp(to_float(row[e]) - top);
    for (int e = 0; e < num_experts; ++e) probs[e] /= sum;
    std::fill(taken.begin(), taken.end(), 0);
    int64_t* id = ids + r * top_k;
    float* w = weights + r * top_k;
    float picked = 0.f;
    for (int j = 0; j < top_k; ++j) {
      int best = -1;
      for (int e = 0; e < num_experts; ++e)  // strictly greater: a tie keeps the lower index
        if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
      taken[best] = 1;
      id[j] = best;
      picked += w[j] = probs[best];
    }
    if (renormalize)
      for (int j = 0; j < top_k; ++j) w[j] /= picked;
  }
}

template <typename T>
void experts(const actorlm_experts& e, const T* x, const int64_t* ids, const float* weights,
             T* out, int64_t rows, int top_k) {
  using G = Gemm<T>;
  const int64_t hidden = e.hidden, inter = e.intermediate, slots = rows * top_k;
  // each row's slots in ascending expert order: slot s of row s / top_k; another rank's
  // experts are group num_experts, past the held ones, which runs nothing
  std::vector<int64_t> slot_expert(slots);
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t held = ids[s] - e.first_expert;
    slot_expert[s] = held >= 0 && held < e.num_experts ? held : e.num_experts;
  }
  std::vector<float> slot_weight(weights, weights + slots);
  for (int64_t r = 0; r < rows; ++r)  // insertion sort: top_k is small
    for (int j = 1; j < top_k; ++j)
      for (int64_t s = r * top_k + j; s > r * top_k && slot_expert[s - 1] > slot_expert[s]; --s) {
        std::swap(slot_expert[s - 1], slot_expert[s]);
        std::swap(slot_weight[s - 1], slot_weight[s]);
      }
  // the slots grouped by expert, in row order within each (a counting sort)
  std::vector<int64_t> start(e.num_experts + 2, 0), order(slots);
  for (int64_t s = 0; s < slots; ++s) ++start[slot_expert[s] + 1];
  int64_t most = 0;  // the most slots a held expert has
  for (int i = 0; i <= e.num_experts; ++i) {
    if (i < e.num_experts) most = std::max(most, start[i + 1]);
    start[i + 1] += start[i];
  }
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t s = 0; s < slots; ++s) order[next[slot_expert[s]]++] = s;
  // zeros: the slots no held expert fills (T's zero bits are 0.0 in fp32 and in bf16)
  std::vector<T> in(most * hidden), gate_up(most * 2 * inter), act(most * inter),
      down(most * hidden), weighted(slots * hidden);
  for (int i = 0; i < e.num_experts; ++i) {
    const int64_t n = start[i + 1] - start[i];
    if (n == 0) continue;
    const int64_t* group = order.data() + start[i];
    for (int64_t j = 0; j < n; ++j)
      std::memcpy(in.data() + j * hidden, x + group[j] / top_k * hidden, hidden * sizeof(T));
    G::linear(in.data(), hidden, static_cast<const T*>(e.gate_up) + i * e.gate_up_stride,
              nullptr, gate_up.data(), n, 2 * inter, hidden);
    G::act_and_mul(gate_up.data(), act.data(), n, int(inter), e.activation);
    G::linear(act.data(), inter, static_cast<const T*>(e.down) + i * e.down_stride, nullptr,
              down.data(), n, hidden, inter);
    for (int64_t j = 0; j < n; ++j) {
      const float w = slot_weight[group[j]];
      const T* y = down.data() + j * hidden;
      T* o = weighted.data() + group[j] * hidden;
      for (int64_t d = 0; d < hidden; ++d) store(to_float(y[d]) * w, o + d);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + r * hidden;
    std::memcpy(o, weighted.data() + r * top_k * hidden, hidden * sizeof(T));
    for (int j = 1; j < top_k; ++j) {
      const T* y = weighted.data() + (r * top_k + j) * hidden;
      for (int64_t d = 0; d < hidden; ++d) store(to_float(o[d]) + to_float(y[d]), o + d);
    }
  }
}

}  // namespace

extern "C" {

#define ACTORLM_MOE(S, T)                                                                     \
  void actorlm_moe_route_##S(const T* logits, int64_t rows, int num_experts, int top_k,      \
                             int renormalize, int64_t* ids, float* weights) {                \
    route(logits, rows, num_experts, top_k, renormalize, ids, weights);                       \
  }                                                                                           \
  void actorlm_moe_experts_##S(const actorlm_experts* e, const T* x, const int64_t* ids,     \
                               const float* weights, T* out, int64_t rows, int top_k) {      \
    experts(*e, x, ids, weights, out, rows, top_k);                                           \
  }
ACTORLM_MOE(f32, float)
ACTORLM_MOE(bf16, uint16_t)

}  // extern "C"
