// A decode step through every decoder layer in one call: fp32, or bf16 (carried as its 16 bits)
// for the rows the bf16 panel GEMM takes.
//
// It executes the layers' descriptions (actorlm_decoder_layer: which norms sit where, RMS or
// LayerNorm, and how they scale, q/k norms per head or over whole projections, q/k/v
// clipping, the activation, a gated or ungated MLP in sequence or in parallel (through the
// attention's norm or its own),
// biases, the attention scale, window and score cap, the RoPE table, the KV-cache group whose
// slots and block table it reads, routed experts in the dense MLP's place), which a model family
// gives (kernels.backend.DecoderLayerPlan), and LoRA adapters' deltas on its projections for
// the rows whose request has one (lora.cpp), over KV caches in the model's dtype or an FP8
// format (the step's kv_type); nothing here knows a family. Each
// layer runs the kernels the Python layers call one by one, in their order, with their bits.
// What goes is the Python between them: a decode step streams hundreds of MB of weights
// through the caches, which evicts the interpreter's working set, so each Python-level op
// after a GEMV cost 20-40 us of cache misses; ten of them a layer were a fifth of a
// one-request SmolLM2 step.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "actorlm_abi.h"
#include "dtype.h"

namespace {

template <typename T>
struct Kernels;
#define ACTORLM_KERNELS_OF(T, S)                                          \
  template <>                                                             \
  struct Kernels<T> {                                                     \
    static constexpr auto rms_norm = actorlm_rms_norm_##S;                \
    static constexpr auto add_rms_norm = actorlm_add_rms_norm_##S;        \
    static constexpr auto layer_norm = actorlm_layer_norm_##S;            \
    static constexpr auto act = actorlm_act_##S;                          \
    static constexpr auto head_rms_norm = actorlm_head_rms_norm_##S;      \
    static constexpr auto act_and_mul = actorlm_act_and_mul_##S;          \
    static constexpr auto linear = actorlm_linear_##S;                    \
    static constexpr auto quant_linear = actorlm_quant_linear_##S;        \
    static constexpr auto moe_route = actorlm_moe_route_##S;              \
    static constexpr auto moe_experts = actorlm_moe_experts_##S;          \
    static constexpr auto lora_add = actorlm_lora_add_##S;                \
    static constexpr auto round_to_fp8 = actorlm_round_to_fp8_##S;        \
  };
ACTORLM_KERNELS_OF(float, f32)
ACTORLM_KERNELS_OF(uint16_t, bf16)

// The kernels that touch the KV caches, for caches that hold T (kKv 0) or an FP8 format (1:
// E4M3, 2: E5M2, the step's kv_type), and the type the caches' values are passed as
template <typename T, int kKv>
struct KvKernels;
#define ACTORLM_KV_KERNELS_OF(T, S, KV, SUFFIX)                          \
  template <>                                                             \
  struct KvKernels<T, KV> {                                               \
    using Stored = std::conditional_t<KV == 0, T, uint8_t>;               \
    static constexpr auto rope_write_kv = actorlm_rope_write_kv_##S##SUFFIX; \
    static constexpr auto decode = actorlm_decode_##S##SUFFIX;            \
  };
ACTORLM_KV_KERNELS_OF(float, f32, 0, )
ACTORLM_KV_KERNELS_OF(float, f32, 1, _e4m3)
ACTORLM_KV_KERNELS_OF(float, f32, 2, _e5m2)
ACTORLM_KV_KERNELS_OF(uint16_t, bf16, 0, )
ACTORLM_KV_KERNELS_OF(uint16_t, bf16, 1, _e4m3)
ACTORLM_KV_KERNELS_OF(uint16_t, bf16, 2, _e5m2)

template <typename T>
inline const T* weight_of(const actorlm_norm& n) { return static_cast<const T*>(n.weight); }

// y [rows, out_features] = x [rows, in_features] (rows `x_stride` apart) through a linear layer:
// the panel GEMM's, or the quantized one's (weights in GGML blocks); the input rounded to FP8
// first where the layer says so
template <typename T>
inline void linear(const actorlm_linear& l, const T* x, int64_t x_stride, T* y, int64_t rows) {
  if (l.fp8_inputs) {
    static thread_local std::vector<T> rounded;
    rounded.resize(rows * l.in_features);
    Kernels<T>::round_to_fp8(x, x_stride, rounded.data(), rows, l.in_features, l.fp8_group,
                             l.fp8_scale);
    x = rounded.data(), x_stride = l.in_features;
  }
  if (l.parts) {
    Kernels<T>::quant_linear(&l, x, x_stride, y, rows);
    return;
  }
  Kernels<T>::linear(x, x_stride, static_cast<const T*>(l.packed), l.bias, y, rows,
                     l.out_features, l.in_features);
}

// y [rows, out_features] (rows `y_stride` apart) += each row's LoRA delta of the layer `l`
// for its input x, where the layer has adapters and the step rows with one (lora.cpp)
template <typename T>
inline void add_lora(const actorlm_lora& lora, const actorlm_linear& l, const int32_t* slots,
                     const T* x, int64_t x_stride, T* y, int64_t y_stride, int64_t rows) {
  if (lora.a && slots)
    Kernels<T>::lora_add(&lora, x, x_stride, y, y_stride, rows, l.in_features, l.out_features,
                         slots);
}

// x [rows, dim] normed in place, where the layer has a norm there
template <typename T>
inline void norm_in_place(const actorlm_norm& n, T* x, int64_t rows, int64_t dim) {
  if (!n.weight) return;
  if (n.layer)
    Kernels<T>::layer_norm(x, dim, x, weight_of<T>(n), static_cast<const T*>(n.bias), rows,
                           int(dim), n.eps);
  else
    Kernels<T>::rms_norm(x, dim, x, weight_of<T>(n), rows, int(dim), n.eps, n.unit_offset);
}

// Features [first, first + dim) of each row of qkv [rows, row_stride] normed as one vector, the
// result rounded in `scratch` [rows, dim] and copied back (OLMoE's q and k norms over all heads;
// the Python layer norms a strided view of q into a new tensor and copies it back alike)
template <typename T>
void projection_norm(const actorlm_norm& n, T* qkv, int64_t row_stride, int64_t first,
                     int64_t dim, int64_t rows, T* scratch) {
  Kernels<T>::rms_norm(qkv + first, row_stride, scratch, weight_of<T>(n), rows, int(dim), n.eps,
                       n.unit_offset);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(qkv + r * row_stride + first, scratch + r * dim, dim * sizeof(T));
}

// every value of x [n] clamped to [-clip, clip], as torch's clamp_ (in fp32, rounded back)
template <typename T>
void clamp_in_place(T* x, int64_t n, float clip) {
  for (int64_t i = 0; i < n; ++i)
    actorlm::store(std::clamp(actorlm::to_float(x[i]), -clip, clip), x + i);
}

// x [rows, hidden], a branch's output, joins the stream `residual` (the sum rounded, as torch's
// add), and x becomes the next branch's input: the stream normed by `n`, or, where the layer
// norms no branch's input (OLMo 2: n has no weight), the stream itself
template <typename T>
void join_stream(const actorlm_norm& n, T* x, T* residual, int64_t rows, int64_t hidden) {
  if (n.weight && !n.layer) {
    Kernels<T>::add_rms_norm(x, residual, weight_of<T>(n), rows, int(hidden), n.eps,
                             n.unit_offset);
    return;
  }
  for (int64_t i = 0; i < rows * hidden; ++i) {
    actorlm::store(actorlm::to_float(x[i]) + actorlm::to_float(residual[i]), residual + i);
    x[i] = residual[i];
  }
  norm_in_place(n, x, rows, hidden);  // (a LayerNorm's, of the sum)
}

// x [rows, hidden] through the dense MLP into out (which may be x): gate_up and down, or, in
// an ungated MLP, its one projection and down
template <typename T>
void dense_mlp(const actorlm_decoder_layer& l, const int32_t* lora_slots, const T* x, T* out,
               int64_t rows, int64_t hidden, T* gate_up, T* activation) {
  const int64_t inter = l.down.in_features;
  linear(l.gate_up, x, hidden, gate_up, rows);
  add_lora(l.gate_up_lora, l.gate_up, lora_slots, x, hidden, gate_up, l.gate_up.out_features,
           rows);
  if (l.gated)
    Kernels<T>::act_and_mul(gate_up, activation, rows, int(inter), l.activation);
  else
    Kernels<T>::act(gate_up, activation, rows, int(inter), l.activation);
  linear(l.down, activation, inter, out, rows);
  add_lora(l.down_lora, l.down, lora_slots, activation, inter, out, hidden, rows);
}

// every value of x [n] times `scale`, as torch's x * scale (in fp32, rounded back); 1: none
template <typename T>
void scale_in_place(T* x, int64_t n, float scale) {
  if (scale == 1.f) return;
  for (int64_t i = 0; i < n; ++i) actorlm::store(actorlm::to_float(x[i]) * scale, x + i);
}

// The step's scratch, sized for its widest layer: [rows, (Hq + 2 Hkv) D], [rows, Hq D],
// [rows, 2 I], [rows, I], each 64-byte aligned (and, for parallel layers, two [rows, hidden]).
template <typename T>
struct Scratch {
  T *qkv, *attention, *gate_up, *activation;
  std::unique_ptr<T, decltype(&std::free)> memory{nullptr, &std::free};
  std::vector<T> branch_input, branch_output;  // a parallel layer's MLP input and output

  Scratch(const actorlm_decoder_layer* layers, int num_layers, int64_t rows) {
    int64_t widths[4] = {0, 0, 0, 0};
    for (int i = 0; i < num_layers; ++i) {
      const actorlm_decoder_layer& l = layers[i];
      widths[0] = std::max(widths[0], l.qkv.out_features);
      widths[1] = std::max(widths[1], int64_t(l.num_heads) * l.head_dim);
      widths[2] = std::max(widths[2], l.gate_up.out_features);
      widths[3] = std::max(widths[3], l.down.in_features);
      if (l.moe) {  // a shared expert's
        widths[2] = std::max(widths[2], l.moe->shared_gate_up.out_features);
        widths[3] = std::max(widths[3], l.moe->shared_down.in_features);
      }
    }
    int64_t offsets[5] = {0};
    for (int i = 0; i < 4; ++i)  // whole cache lines each
      offsets[i + 1] = offsets[i] + (rows * widths[i] * int64_t(sizeof(T)) + 63) / 64 * 64;
    memory.reset(static_cast<T*>(std::aligned_alloc(64, std::max<int64_t>(64, offsets[4]))));
    char* base = reinterpret_cast<char*>(memory.get());
    T** parts[4] = {&qkv, &attention, &gate_up, &activation};
    for (int i = 0; i < 4; ++i) *parts[i] = reinterpret_cast<T*>(base + offsets[i]);
  }
};

// x [rows, hidden] through a mixture of experts in place (moe.cpp routes and runs them; the
// shared expert's sum follows torch's ops: sigmoid(gate) rounded, times the shared expert's
// output rounded, added to the experts' rounded; without a gate, Granite's, the output
// itself added). The router scores all of its experts, of
// which m.experts may hold a share (expert parallelism). Its router's and experts' seconds
// are added to `seconds` where given (three clock reads a layer: tens of nanoseconds).
template <typename T>
void moe_mlp(const actorlm_moe& m, int activation, T* x, int64_t rows, int64_t hidden,
             Scratch<T>& t, actorlm_moe_seconds* seconds) {
  using K = Kernels<T>;
  using Clock = std::chrono::steady_clock;
  const int num_experts = int(m.router.out_features), top_k = m.top_k;
  std::vector<T> logits(rows * num_experts), out(rows * hidden);
  std::vector<int64_t> ids(rows * top_k);
  std::vector<float> weights(rows * top_k);
  const Clock::time_point t_start = Clock::now();
  linear(m.router, x, hidden, logits.data(), rows);
  K::moe_route(logits.data(), rows, num_experts, top_k, m.renormalize, ids.data(),
               weights.data());
  const Clock::time_point t_routed = Clock::now();
  K::moe_experts(&m.experts, x, ids.data(), weights.data(), out.data(), rows, top_k);
  if (m.shared_gate_up.out_features) {
    const int64_t inter = m.shared_down.in_features;
    std::vector<T> shared(rows * hidden), gate(rows);
    linear(m.shared_gate_up, x, hidden, t.gate_up, rows);
    K::act_and_mul(t.gate_up, t.activation, rows, int(inter), activation);
    linear(m.shared_down, t.activation, inter, shared.data(), rows);
    const bool gated = m.shared_gate.out_features != 0;
    if (gated) linear(m.shared_gate, x, hidden, gate.data(), rows);
    for (int64_t r = 0; r < rows; ++r) {
      T* o = out.data() + r * hidden;
      T* y = shared.data() + r * hidden;
      if (gated) {
        const T* gate_row = gate.data() + r;
        const float scale = actorlm::rounded(
            1.f / (1.f + std::exp(-actorlm::to_float(*gate_row))), gate_row);
        // the product stored before the sum, in two loops: one expression would let
        // -ffast-math fuse them into an FMA, which torch's two ops do not
        for (int64_t d = 0; d < hidden; ++d)
          actorlm::store(scale * actorlm::to_float(y[d]), y + d);
      }
      for (int64_t d = 0; d < hidden; ++d)
        actorlm::store(actorlm::to_float(o[d]) + actorlm::to_float(y[d]), o + d);
    }
  }
  std::memcpy(x, out.data(), rows * hidden * sizeof(T));
  if (seconds) {
    seconds->router += std::chrono::duration<double>(t_routed - t_start).count();
    seconds->experts += std::chrono::duration<double>(Clock::now() - t_routed).count();
  }
}

// x, residual [rows, hidden]: in, the embeddings (residual's contents are ignored); out, the
// last layer's output and the residual stream before it (the model's final norm adds them).
template <typename T, int kKv>
void decode_layers(const actorlm_decoder_layer* layers, int num_layers,
                   const actorlm_decode_step& s, T* x, T* residual) {
  using K = Kernels<T>;
  using KV = KvKernels<T, kKv>;
  using Stored = typename KV::Stored;
  const int64_t rows = s.rows, hidden = layers[0].qkv.in_features;
  Scratch<T> t(layers, num_layers, rows);
  for (int i = 0; i < num_layers; ++i) {
    const actorlm_decoder_layer& l = layers[i];
    const int64_t q_size = int64_t(l.num_heads) * l.head_dim, qkv_size = l.qkv.out_features;
    Stored* const k_cache = static_cast<Stored*>(l.k_cache);
    Stored* const v_cache = static_cast<Stored*>(l.v_cache);
    const actorlm_kv_group& g = s.groups[l.kv_group];
    if (i == 0) {  // the stream starts as the embeddings
      std::memcpy(residual, x, rows * hidden * sizeof(T));
      norm_in_place(l.attn_norm, x, rows, hidden);
    } else {  // the previous layer's output joins the stream
      join_stream(l.attn_norm, x, residual, rows, hidden);
    }
    if (l.parallel && l.mlp_norm.weight) {  // the MLP's input: the stream through its own norm
      t.branch_input.assign(residual, residual + rows * hidden);
      norm_in_place(l.mlp_norm, t.branch_input.data(), rows, hidden);
    } else if (l.parallel) {  // the attention's input
      t.branch_input.assign(x, x + rows * hidden);
    }
    linear(l.qkv, x, hidden, t.qkv, rows);
    add_lora(l.qkv_lora, l.qkv, s.lora_slots, x, hidden, t.qkv, qkv_size, rows);
    if (l.q_norm.weight && l.projection_norms) {
      projection_norm(l.q_norm, t.qkv, qkv_size, 0, q_size, rows, t.attention);
      projection_norm(l.k_norm, t.qkv, qkv_size, q_size, int64_t(l.num_kv_heads) * l.head_dim,
                      rows, t.attention);
    } else if (l.q_norm.weight) {
      K::head_rms_norm(t.qkv, qkv_size, rows, l.num_heads, l.num_kv_heads, l.head_dim,
                       weight_of<T>(l.q_norm), weight_of<T>(l.k_norm), l.q_norm.eps,
                       l.q_norm.unit_offset);
    }
    if (l.clip_qkv > 0) clamp_in_place(t.qkv, rows * qkv_size, l.clip_qkv);
    KV::rope_write_kv(t.qkv, qkv_size, static_cast<const T*>(s.cos[l.rope]),
                     static_cast<const T*>(s.sin_signed[l.rope]), k_cache, v_cache, g.slots,
                     rows, l.num_heads, l.num_kv_heads, l.head_dim);
    KV::decode(t.qkv, qkv_size, nullptr, k_cache, v_cache, g.block_tables, g.max_blocks,
              s.seq_lens, t.attention, int(rows), l.num_heads, l.num_kv_heads, l.head_dim,
              s.block_size, l.scale, l.window, l.softcap);
    linear(l.o, t.attention, q_size, x, rows);
    add_lora(l.o_lora, l.o, s.lora_slots, t.attention, q_size, x, hidden, rows);
    if (l.parallel) {  // the layer's output: attention's + the MLP's (of the same input)
      t.branch_output.resize(rows * hidden);
      dense_mlp(l, s.lora_slots, t.branch_input.data(), t.branch_output.data(), rows, hidden,
                t.gate_up, t.activation);
      for (int64_t j = 0; j < rows * hidden; ++j)
        actorlm::store(actorlm::to_float(x[j]) + actorlm::to_float(t.branch_output[j]), x + j);
      continue;
    }
    norm_in_place(l.attn_out_norm, x, rows, hidden);
    scale_in_place(x, rows * hidden, l.residual_scale);
    join_stream(l.mlp_norm, x, residual, rows, hidden);
    if (l.moe)
      moe_mlp(*l.moe, l.activation, x, rows, hidden, t, s.moe_seconds);
    else
      dense_mlp(l, s.lora_slots, x, x, rows, hidden, t.gate_up, t.activation);
    norm_in_place(l.mlp_out_norm, x, rows, hidden);
    scale_in_place(x, rows * hidden, l.residual_scale);
  }
}

// decode_layers for the caches the step says it has
template <typename T>
void decode_layers_of(const actorlm_decoder_layer* layers, int num_layers,
                      const actorlm_decode_step& s, T* x, T* residual) {
  switch (s.kv_type) {
    case 1: return decode_layers<T, 1>(layers, num_layers, s, x, residual);
    case 2: return decode_layers<T, 2>(layers, num_layers, s, x, residual);
    default: return decode_layers<T, 0>(layers, num_layers, s, x, residual);
  }
}

}  // namespace

extern "C" {

void actorlm_decode_layers_f32(const actorlm_decoder_layer* layers, int num_layers,
                               const actorlm_decode_step* step, float* x, float* residual) {
  decode_layers_of(layers, num_layers, *step, x, residual);
}
void actorlm_decode_layers_bf16(const actorlm_decoder_layer* layers, int num_layers,
                                const actorlm_decode_step* step, uint16_t* x,
                                uint16_t* residual) {
  decode_layers_of(layers, num_layers, *step, x, residual);
}

}  // extern "C"
