"""The CPU backend: the C++ kernels of this wing, each with its torch path for where the library
is not built or the tensors are not what a kernel takes."""

from __future__ import annotations

import torch

from actorlm.kernels import moe, portable
from actorlm.kernels.backend import AttentionLayer, KernelBackend, Norm, QuantizedWeight
from actorlm.kernels.cpu import attention, fused, linear, lora, quant, sampler
from actorlm.kernels.cpu.experts import PanelExperts
from actorlm.kernels.cpu.decode_step import DecodeStep


class CpuBackend(KernelBackend):
    name = "cpu"

    def rms_norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        return fused.rms_norm(x, norm)

    def add_rms_norm(self, x, residual, norm):
        return fused.add_rms_norm(x, residual, norm)

    def act_and_mul(self, gate_up, activation):
        return fused.act_and_mul(gate_up, activation)

    def prepare_linear(self, weight, bias):
        if isinstance(weight, (QuantizedWeight, tuple, list)):
            return quant.QuantLinear([weight] if isinstance(weight, QuantizedWeight) else weight,
                                     bias)
        return linear.packed_linear(weight, bias) or linear.PlainLinear(weight, bias)

    def quantize_inputs(self, linear, quant, row_max=None):
        return fused.QuantizedInputs(quant, linear, row_max)

    def prepare_embedding(self, weight, dtype):
        return lambda ids: quant.dequantize_rows(weight, ids, dtype)

    def prepare_tied_embedding(self, weight, dtype):
        head = quant.QuantLinear([weight], None)  # (interleaved where the VNNI kernels run)
        return lambda ids: head.rows(ids, dtype), head

    def _plan(self, q_lens, seq_lens, block_ids, block_size, tables):
        return attention.plan_attention(q_lens, seq_lens, block_ids, block_size, self.device,
                                        tables=tables)

    def attention(self, qkv, cos, sin_signed, kv_cache, meta, layer: AttentionLayer):
        k_cache, v_cache = kv_cache
        num_tokens, heads = qkv.shape[0], (layer.num_heads, layer.num_kv_heads, layer.head_dim)
        q_norm, k_norm = layer.q_norm, layer.k_norm
        if q_norm is not None and fused.head_rms_norm(qkv, *heads, q_norm, k_norm):
            q_norm = k_norm = None  # normed in place
        if fused.rope_and_write_kv(qkv, cos, sin_signed, k_cache, v_cache, meta.slot_mapping,
                                   *heads[:2]):
            query = qkv[:, :layer.num_heads * layer.head_dim].view(num_tokens, *heads[::2])
        else:
            query, k, v = portable.split_qkv(qkv, cos, sin_signed, *heads, q_norm, k_norm)
            portable.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = attention.attend(query, k_cache, v_cache, meta.plan, layer.scale, layer.window,
                               layer.softcap, layer.sinks)  # [T, Hq, D]
        return out.reshape(num_tokens, -1)

    def prepare_experts(self, experts):
        if experts.is_quantized:  # each expert's layers on the quantized kernels (QuantLinear)
            return moe.LinearExperts(experts, self.prepare_linear, fused.act_and_mul)
        return PanelExperts.build(experts) or experts

    def fused_moe(self, x, router_logits, experts, top_k, renormalize):
        if isinstance(experts, (PanelExperts, moe.LinearExperts)):
            return experts(x, router_logits, top_k, renormalize)
        return moe.fused_moe(x, router_logits, experts, top_k, renormalize, fused.act_and_mul)

    def sample(self, logits, temperature, top_k, top_p, min_p, seeds, positions):
        return sampler.sample(logits, temperature, top_k, top_p, min_p, seeds, positions)

    def argmax(self, logits):
        return fused.argmax(logits)

    def add_lora(self, y, x, table, mapping):
        return lora.add_lora(y, x, table, mapping)

    def decode_step(self, layers, dtype):
        return DecodeStep.build(layers, dtype)
