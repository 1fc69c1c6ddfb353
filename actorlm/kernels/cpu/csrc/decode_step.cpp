// A decode step through every decoder layer of a Llama-family model in one call: fp32, or bf16
// (carried as its 16 bits) for the rows the bf16 panel GEMM takes.
//
// Each layer runs the kernels the Python layers call one by one (the norms, the panel GEMMs,
// RoPE with the K/V write, decode attention, SiLU-and-mul), in their order, with their bits.
// What goes is the Python between them: a decode step streams hundreds of MB of weights
// through the caches, which evicts the interpreter's working set, so each Python-level op
// after a GEMV cost 20-40 us of cache misses; ten of them a layer were a fifth of a
// one-request SmolLM2 step.
#include <cstdint>

extern "C" {
#define ACTORLM_LAYER_KERNELS(T, S)                                                              \
  void actorlm_add_rms_norm_##S(T* x, T* residual, const T* weight, int64_t rows, int dim,       \
                                float eps);                                                     \
  void actorlm_silu_and_mul_##S(const T* gate_up, T* out, int64_t rows, int dim);               \
  void actorlm_rope_write_kv_##S(T* qkv, int64_t row_stride, const T* cos, const T* sin_signed, \
                                 T* k_cache, T* v_cache, const int64_t* slots, int64_t rows,     \
                                 int num_heads, int num_kv_heads, int head_dim);                \
  void actorlm_decode_##S(const T* query, int64_t query_row_stride, const int32_t* rows,        \
                          const T* k_cache, const T* v_cache, const int32_t* block_tables,      \
                          int max_blocks, const int32_t* seq_lens, T* out, int num_requests,    \
                          int num_heads, int num_kv_heads, int head_dim, int block_size,        \
                          float scale);                                                         \
  void actorlm_linear_##S(const T* x, int64_t x_stride, const T* packed, const float* bias,      \
                          T* y, int64_t m, int64_t n, int64_t k);
ACTORLM_LAYER_KERNELS(float, f32)
ACTORLM_LAYER_KERNELS(uint16_t, bf16)
}

namespace {

// One decoder layer: its weights packed for actorlm_linear_* (fp32 biases padded, or null) and
// its paged caches [num_blocks, block_size, num_kv_heads, head_dim].
template <typename T>
struct Layer {
  const T* input_norm;
  const T* post_attention_norm;
  const T* qkv;
  const float* qkv_bias;
  const T* o;
  const float* o_bias;
  const T* gate_up;
  const float* gate_up_bias;
  const T* down;
  const float* down_bias;
  T* k_cache;
  T* v_cache;
};

struct Shape {
  int64_t hidden;
  int64_t intermediate;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t block_size;
  float eps;
  float scale;
};

// One query token per request, request r on row r.
template <typename T>
struct Step {
  int64_t rows;
  const T* cos;         // [rows, head_dim]
  const T* sin_signed;  // [rows, head_dim]
  const int64_t* slots;         // [rows]
  const int32_t* block_tables;  // [rows, max_blocks]
  int32_t max_blocks;
  const int32_t* seq_lens;  // [rows]
  // scratch: [rows, (Hq + 2 Hkv) * D], [rows, Hq * D], [rows, 2 I], [rows, I]
  T* qkv;
  T* attention;
  T* gate_up;
  T* activation;
};

template <typename T>
struct Kernels;
#define ACTORLM_KERNELS_OF(T, S)                                          \
  template <>                                                             \
  struct Kernels<T> {                                                     \
    static constexpr auto add_rms_norm = actorlm_add_rms_norm_##S;        \
    static constexpr auto silu_and_mul = actorlm_silu_and_mul_##S;        \
    static constexpr auto rope_write_kv = actorlm_rope_write_kv_##S;      \
    static constexpr auto decode = actorlm_decode_##S;                    \
    static constexpr auto linear = actorlm_linear_##S;                    \
  };
ACTORLM_KERNELS_OF(float, f32)
ACTORLM_KERNELS_OF(uint16_t, bf16)

// x, residual [rows, hidden]: in, the first layer's normed input and the embeddings (its input
// norm is torch's, as in the Python layers); out, the last layer's output and the residual
// stream before it (the model's final norm adds them).
template <typename T>
void decode_layers(const Layer<T>* layers, int num_layers, const Shape& s, const Step<T>& t,
                   T* x, T* residual) {
  using K = Kernels<T>;
  const int64_t q_size = int64_t(s.num_heads) * s.head_dim;
  const int64_t qkv_size = q_size + 2 * int64_t(s.num_kv_heads) * s.head_dim;
  for (int i = 0; i < num_layers; ++i) {
    const Layer<T>& l = layers[i];
    if (i > 0) K::add_rms_norm(x, residual, l.input_norm, t.rows, int(s.hidden), s.eps);
    K::linear(x, s.hidden, l.qkv, l.qkv_bias, t.qkv, t.rows, qkv_size, s.hidden);
    K::rope_write_kv(t.qkv, qkv_size, t.cos, t.sin_signed, l.k_cache, l.v_cache, t.slots,
                     t.rows, s.num_heads, s.num_kv_heads, s.head_dim);
    K::decode(t.qkv, qkv_size, nullptr, l.k_cache, l.v_cache, t.block_tables, t.max_blocks,
              t.seq_lens, t.attention, int(t.rows), s.num_heads, s.num_kv_heads, s.head_dim,
              s.block_size, s.scale);
    K::linear(t.attention, q_size, l.o, l.o_bias, x, t.rows, s.hidden, q_size);
    K::add_rms_norm(x, residual, l.post_attention_norm, t.rows, int(s.hidden), s.eps);
    K::linear(x, s.hidden, l.gate_up, l.gate_up_bias, t.gate_up, t.rows, 2 * s.intermediate,
              s.hidden);
    K::silu_and_mul(t.gate_up, t.activation, t.rows, int(s.intermediate));
    K::linear(t.activation, s.intermediate, l.down, l.down_bias, x, t.rows, s.hidden,
              s.intermediate);
  }
}

}  // namespace

extern "C" {

void actorlm_decode_layers_f32(const Layer<float>* layers, int num_layers, const Shape* shape,
                               const Step<float>* step, float* x, float* residual) {
  decode_layers(layers, num_layers, *shape, *step, x, residual);
}
void actorlm_decode_layers_bf16(const Layer<uint16_t>* layers, int num_layers,
                                const Shape* shape, const Step<uint16_t>* step, uint16_t* x,
                                uint16_t* residual) {
  decode_layers(layers, num_layers, *shape, *step, x, residual);
}

}  // extern "C"
