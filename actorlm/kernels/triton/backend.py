"""The GPU backend: Triton kernels for the norms, activations, the K/V write, paged attention,
sampling, speculative decoding's verification walk (after torch's target distributions), the
linear layers in GGUF blocks, the routed experts (a grouped GEMM over the slots sorted by
expert; experts in GGUF blocks: each expert's rows through the quantized GEMM) and LoRA
adapters' deltas (a grouped shrink and expand over the rows sorted by adapter); cuBLAS
(``F.linear``) for the dense linear layers; torch ops for RoPE."""

from __future__ import annotations

import torch.nn.functional as F

from actorlm.kernels import moe, portable
from actorlm.kernels.backend import AttentionLayer, KernelBackend, QuantizedWeight


class TritonBackend(KernelBackend):
    name = "triton"

    def rms_norm(self, x, norm):
        from actorlm.kernels.triton.norms import rms_norm

        if x.dim() != 2:  # per-head norms of [T, H, D]: rows of D
            return rms_norm(x.reshape(-1, x.shape[-1]), norm.weight, norm.eps,
                            norm.unit_offset).view(x.shape)
        return rms_norm(x, norm.weight, norm.eps, norm.unit_offset)

    def add_rms_norm(self, x, residual, norm):
        from actorlm.kernels.triton.norms import add_rms_norm

        return add_rms_norm(x, residual, norm.weight, norm.eps, norm.unit_offset)

    def act_and_mul(self, gate_up, activation):
        from actorlm.kernels.triton.activation import act_and_mul

        return act_and_mul(gate_up, activation)

    def prepare_linear(self, weight, bias):
        if isinstance(weight, (QuantizedWeight, tuple, list)):
            from actorlm.kernels.triton.quant_linear import TritonQuantLinear

            return TritonQuantLinear(weight, bias, self.device)
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
        return lambda x: F.linear(x, weight, bias)

    def prepare_embedding(self, weight, dtype):
        from actorlm.kernels import portable

        table = portable.dequantize(weight, dtype).to(self.device)  # once: GPU memory is ample
        return lambda ids: F.embedding(ids, table)

    def attention(self, qkv, cos, sin_signed, kv_cache, meta, layer: AttentionLayer):
        from actorlm.kernels.triton.paged_attention import paged_attention
        from actorlm.kernels.triton.write_kv import write_kv

        num_tokens, d = qkv.shape[0], layer.head_dim
        q_size, kv_size = layer.num_heads * d, layer.num_kv_heads * d
        q = qkv[:, :q_size].view(num_tokens, layer.num_heads, d)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, layer.num_kv_heads, d)
        v = qkv[:, q_size + kv_size:].view(num_tokens, layer.num_kv_heads, d)
        if layer.q_norm is not None:
            q, k = self.rms_norm(q, layer.q_norm), self.rms_norm(k, layer.k_norm)
        q, k = portable.apply_rope(q, cos, sin_signed), portable.apply_rope(k, cos, sin_signed)
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                              meta.seq_lens, layer.scale, max_query_len=meta.max_query_len,
                              max_seq_len=meta.max_seq_len, window=layer.window,
                              softcap=layer.softcap, sinks=layer.sinks)
        return out.reshape(num_tokens, q_size)

    def add_lora(self, y, x, table, mapping):
        from actorlm.kernels.triton.lora import add_lora

        return add_lora(y, x, table, mapping)

    def prepare_experts(self, experts):
        if experts.is_quantized:
            # each expert's layers on the quantized GEMM, one pair of launches per expert a step
            # touches (and a host sync a layer, to group the rows): correct, not yet fast
            return moe.LinearExperts(experts, self.prepare_linear, self.act_and_mul)
        return experts

    def fused_moe(self, x, router_logits, experts, top_k, renormalize):
        from actorlm.kernels.triton.fused_moe import fused_moe

        if isinstance(experts, moe.LinearExperts):
            return experts(x, router_logits, top_k, renormalize)
        return fused_moe(x, router_logits, experts, top_k, renormalize)

    def sample(self, logits, temperature, top_k, top_p, min_p, seeds, positions):
        from actorlm.kernels.triton.sampling import sample

        return sample(logits, temperature, top_k, top_p, min_p, seeds, positions)

    def rejection_sample(self, logits, num_drafts, draft_token_ids, temperature, top_k, top_p,
                         min_p, seeds, positions):
        from actorlm.kernels.triton.rejection import rejection_sample

        return rejection_sample(logits, num_drafts, draft_token_ids, temperature, top_k, top_p,
                                min_p, seeds, positions)
