"""Torch ops that run on any device with the bits of HF transformers' layers: the CPU wing's
path where its C++ library is not built (or the tensors are not what a kernel takes), and the
GPU wing's where no Triton kernel is worth it (RoPE).

HF's order matters in bf16: the residual sum is rounded to bf16, an RMS norm normalises in fp32
and rounds before the weight multiplies (``1 + weight`` in fp32, rounded once, for a
unit-offset norm), and act(gate) is rounded before it multiplies up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from actorlm.kernels.backend import (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, ActivationQuant,
                                     AttentionLayer, Norm, QuantizedWeight, check_activation)

_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max  # 448
_FP8_MIN_SCALE = 1 / (_FP8_MAX * 512)  # vLLM's floor: a row of zeros stays zeros


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The values [out, in] of a weight in GGUF blocks, by the ``gguf`` package (numpy, on the
    CPU), rounded once to ``dtype``: at load, where no kernel takes the blocks."""
    import gguf

    blocks = weight.blocks.detach().cpu().contiguous().view(torch.uint8).numpy()
    values = gguf.quants.dequantize(blocks.reshape(weight.shape[0], -1),
                                    gguf.GGMLQuantizationType[weight.type_name])
    return torch.from_numpy(values).view(weight.shape).to(dtype)


def round_to_fp8(x: torch.Tensor, quant: ActivationQuant, row_max=None) -> torch.Tensor:
    """x [T, in] rounded to FP8 e4m3 values times their scale (``ActivationQuant``), in x's
    dtype: each step in fp32 (the scale, the largest magnitude times 1 / 448 and at least
    vLLM's floor; x times its reciprocal, clamped to +-448; the rounding to nearest even; the
    product), as vLLM's FP8 kernels quantize their input (``csrc/fp8.cpp``: the same bits).
    ``row_max`` joins a row's largest magnitude [T, 1] over the ranks that share the row."""
    h = x.float()
    if quant.scale is not None:
        scale = torch.tensor(quant.scale, dtype=torch.float32, device=x.device)
    else:
        if quant.group is not None:
            h = h.unflatten(-1, (-1, quant.group))  # [T, groups, group]
        largest = h.abs().amax(-1, keepdim=True)
        if row_max is not None and quant.group is None:
            largest = row_max(largest)
        scale = (largest * (1 / _FP8_MAX)).clamp(min=_FP8_MIN_SCALE)
    q = (h * (1 / scale)).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
    return (q.float() * scale).reshape(x.shape).to(x.dtype)


class QuantizedInputs:
    """A prepared linear layer ``linear`` whose input is first rounded as ``quant`` says; a
    backend's decode step may take the pair apart and round in its own kernel, with the same
    bits."""

    def __init__(self, quant: ActivationQuant, linear, row_max=None):
        self.quant, self.linear, self.row_max = quant, linear, row_max

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(round_to_fp8(x, self.quant, self.row_max))


def rms_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    shape = norm.weight.shape
    if norm.unit_offset:
        normed = torch.rms_norm(x.float(), shape, None, norm.eps)
        return (normed * (1.0 + norm.weight.float())).to(x.dtype)
    if x.dtype == torch.float32:  # one op, with HF's fp32 bits
        return torch.rms_norm(x, shape, norm.weight, norm.eps)
    return norm.weight * torch.rms_norm(x.float(), shape, None, norm.eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor,
                 norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm(residual, norm), residual


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    check_activation(activation)
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "swiglu_oai":
        return swiglu_oai(gate, up)
    return ACTIVATION_FUNCTIONS[activation](gate) * up


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU, op by op as transformers computes it in the model dtype."""
    gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    up = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


# each activation as transformers computes it (in the model dtype), by the kernels' names
ACTIVATION_FUNCTIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
                        "relu": F.relu, "relu2": lambda x: torch.square(F.relu(x)),
                        "gelu": F.gelu}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin_signed: [T, 1, D]. HF's ``x * cos + rotate_half(x) * sin`` with
    the negation of rotate_half moved into the table (``sin_signed`` is sin with its first half
    negated): the same bits in four ops instead of seven."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value [T, Hkv, D] into the paged caches at ``slot_mapping`` [T] (all valid), as
    ``cache_values`` rounds them."""
    for x, cache in ((key, k_cache), (value, v_cache)):
        x = cache_values(x, cache.dtype)
        if cache.dtype.itemsize == 1:  # (index_copy_ has no FP8 kernel: their bytes, then)
            x, cache = x.view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, *cache.shape[-2:]).index_copy_(0, slot_mapping, x)


def cache_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of ``dtype`` holds it: an FP8 cache's values rounded to the nearest (even)
    and saturated at its largest finite one (vLLM's conversion, with a scale of one)."""
    if x.dtype == dtype:
        return x
    if dtype.itemsize == 1:
        top = torch.finfo(dtype).max
        return x.float().clamp(-top, top).to(dtype)
    return x.to(dtype)


def split_qkv(qkv, cos, sin_signed, num_heads, num_kv_heads, head_dim, q_norm=None,
              k_norm=None):
    """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) from a fused projection, q and k normed
    per head (where given) and rotated."""
    num_tokens, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    v = qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)
    if q_norm is None:  # q and k rotate as one tensor: [T, Hq + Hkv, D]
        qk = apply_rope(qkv[:, :q_size + kv_size].view(num_tokens, -1, head_dim), cos,
                        sin_signed)
        return qk[:, :num_heads], qk[:, num_heads:], v
    q = rms_norm(qkv[:, :q_size].view(num_tokens, num_heads, head_dim), q_norm)
    k = rms_norm(qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim),
                 k_norm)
    return apply_rope(q, cos, sin_signed), apply_rope(k, cos, sin_signed), v


def turn_qk(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
            layer: AttentionLayer) -> None:
    """q and k of a fused projection qkv [T, (Hq + 2 Hkv) * D] normed per head (where the
    layer has norms) and rotated, in place: for attention that turns nothing itself
    (``KernelBackend.bidirectional_attention``)."""
    q_size, kv_size = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    q, k, _ = split_qkv(qkv, cos, sin_signed, layer.num_heads, layer.num_kv_heads,
                        layer.head_dim, layer.q_norm, layer.k_norm)
    qkv[:, :q_size].copy_(q.flatten(1))
    qkv[:, q_size:q_size + kv_size].copy_(k.flatten(1))


def bidirectional_attention(qkv: torch.Tensor, query_start_loc, layer: AttentionLayer,
                            score_bias=None) -> torch.Tensor:
    """``KernelBackend.bidirectional_attention``: one SDPA call per request, over its own rows
    only, so no request's padding or mask costs another's."""
    hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    out = qkv.new_empty(qkv.shape[0], hq * d)
    starts = list(query_start_loc)
    for begin, end in zip(starts, starts[1:]):
        rows = qkv[begin:end]
        # [1, heads, rows, D]: a batch of one, which torch's fused CPU kernel takes (3-D
        # inputs fall back to its math path, a third slower)
        q, k, v = (rows[:, first:first + heads * d].view(1, end - begin, heads, d).transpose(1, 2)
                   for first, heads in ((0, hq), (hq * d, hkv), ((hq + hkv) * d, hkv)))
        mask = _score_mask(end - begin, layer, score_bias, q.dtype, q.device)
        o = F.scaled_dot_product_attention(q, k, v, mask, scale=layer.scale,
                                           enable_gqa=hq != hkv)
        out[begin:end] = o[0].transpose(0, 1).reshape(end - begin, hq * d)
    return out


def _score_mask(n: int, layer: AttentionLayer, score_bias, dtype, device
                ) -> torch.Tensor | None:
    """SDPA's mask of a request of n rows: its score bias [1, Hq, n, n] (in ``dtype``), with
    -inf beyond the window; the window's keys [n, n] (True: seen) alone; or None."""
    seen = None
    if layer.window is not None and n > layer.window + 1:
        rows = torch.arange(n, device=device)
        seen = (rows[:, None] - rows[None, :]).abs() <= layer.window
    if score_bias is None:
        return seen
    bias = score_bias(n)[None].to(device=device, dtype=dtype)
    return bias if seen is None else bias.masked_fill(~seen, float("-inf"))
