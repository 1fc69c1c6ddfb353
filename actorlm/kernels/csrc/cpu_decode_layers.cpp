// A decode step through every decoder layer of a Llama-family model, fp32, in one call.
//
// Each layer runs the kernels the Python layers call one by one (the norms, the panel GEMMs,
// RoPE with the K/V write, decode attention, SiLU-and-mul), in their order, with their bits.
// What goes is the Python between them: a decode step streams hundreds of MB of weights through the
// caches, which evicts the interpreter's working set, so each Python-level op after a GEMV cost
// ~30 us of cache misses; ten of them per layer were a fifth of a one-request SmolLM2 step.
#include <cstdint>

extern "C" {
void actorlm_add_rms_norm_f32(float* x, float* residual, const float* weight, int64_t rows,
                              int dim, float eps);
void actorlm_silu_and_mul_f32(const float* gate_up, float* out, int64_t rows, int dim);
void actorlm_rope_write_kv_f32(float* qkv, int64_t row_stride, const float* cos,
                               const float* sin_signed, float* k_cache, float* v_cache,
                               const int64_t* slots, int64_t rows, int num_heads,
                               int num_kv_heads, int head_dim);
void actorlm_decode_f32(const float* query, int64_t query_row_stride, const int32_t* rows,
                        const float* k_cache, const float* v_cache, const int32_t* block_tables,
                        int max_blocks, const int32_t* seq_lens, float* out, int num_requests,
                        int num_heads, int num_kv_heads, int head_dim, int block_size,
                        float scale);
void actorlm_linear_f32(const float* x, int64_t x_stride, const float* packed, const float* bias,
                        float* y, int64_t m, int64_t n, int64_t k);
}

namespace {

// One decoder layer: its weights packed for actorlm_linear_f32 (biases padded, or null) and its
// paged caches [num_blocks, block_size, num_kv_heads, head_dim].
struct Layer {
  const float* input_norm;
  const float* post_attention_norm;
  const float* qkv;
  const float* qkv_bias;
  const float* o;
  const float* o_bias;
  const float* gate_up;
  const float* gate_up_bias;
  const float* down;
  const float* down_bias;
  float* k_cache;
  float* v_cache;
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
struct Step {
  int64_t rows;
  const float* cos;         // [rows, head_dim]
  const float* sin_signed;  // [rows, head_dim]
  const int64_t* slots;     // [rows]
  const int32_t* block_tables;  // [rows, max_blocks]
  int32_t max_blocks;
  const int32_t* seq_lens;  // [rows]
  // scratch: [rows, (Hq + 2 Hkv) * D], [rows, Hq * D], [rows, 2 I], [rows, I]
  float* qkv;
  float* attention;
  float* gate_up;
  float* activation;
};

}  // namespace

extern "C" {

// x, residual [rows, hidden]: in, the first layer's normed input and the embeddings (its input
// norm is torch's, as in the Python layers); out, the last layer's output and the residual
// stream before it (the model's final norm adds them).
void actorlm_decode_layers_f32(const Layer* layers, int num_layers, const Shape* shape,
                               const Step* step, float* x, float* residual) {
  const Shape& s = *shape;
  const Step& t = *step;
  const int64_t q_size = int64_t(s.num_heads) * s.head_dim;
  const int64_t qkv_size = q_size + 2 * int64_t(s.num_kv_heads) * s.head_dim;
  for (int i = 0; i < num_layers; ++i) {
    const Layer& l = layers[i];
    if (i > 0)
      actorlm_add_rms_norm_f32(x, residual, l.input_norm, t.rows, int(s.hidden), s.eps);
    actorlm_linear_f32(x, s.hidden, l.qkv, l.qkv_bias, t.qkv, t.rows, qkv_size, s.hidden);
    actorlm_rope_write_kv_f32(t.qkv, qkv_size, t.cos, t.sin_signed, l.k_cache, l.v_cache,
                              t.slots, t.rows, s.num_heads, s.num_kv_heads, s.head_dim);
    actorlm_decode_f32(t.qkv, qkv_size, nullptr, l.k_cache, l.v_cache, t.block_tables,
                       t.max_blocks, t.seq_lens, t.attention, int(t.rows), s.num_heads,
                       s.num_kv_heads, s.head_dim, s.block_size, s.scale);
    actorlm_linear_f32(t.attention, q_size, l.o, l.o_bias, x, t.rows, s.hidden, q_size);
    actorlm_add_rms_norm_f32(x, residual, l.post_attention_norm, t.rows, int(s.hidden), s.eps);
    actorlm_linear_f32(x, s.hidden, l.gate_up, l.gate_up_bias, t.gate_up, t.rows,
                       2 * s.intermediate, s.hidden);
    actorlm_silu_and_mul_f32(t.gate_up, t.activation, t.rows, int(s.intermediate));
    actorlm_linear_f32(t.activation, s.intermediate, l.down, l.down_bias, x, t.rows, s.hidden,
                       s.intermediate);
  }
}

}  // extern "C"
