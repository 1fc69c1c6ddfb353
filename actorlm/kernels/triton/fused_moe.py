"""Triton routed experts: a grouped GEMM over the slots sorted by expert, in the spirit of
vLLM's ``fused_moe``.

Each token is routed (``moe.route``: softmax top-k in fp32) and its slots are sorted by
expert id, so that its slot j holds its j-th smallest expert. ``moe_align.py`` lays the
slots on this rank's experts out in blocks of ``BLOCK_M`` rows of one expert. Then three
launches:

1. gate/up: one program per (block, ``BLOCK_N`` intermediate features) multiplies its rows of
   x by the expert's gate and up rows at once (two fp32 accumulators), adds the expert's
   ``gate_up_bias`` where it has one, rounds both to x's dtype and applies the activation in
   HF's rounding order (``activation.gated_activation``): a hidden row [I] per slot.
2. down: the same kernel over the hidden rows and the expert's down projection, plus its
   ``down_bias``, its output rounded to the dtype, multiplied in fp32 by the slot's routing
   weight and rounded again: a row [H] per slot.
3. each token's slots summed in ascending expert order, each sum rounded to the dtype, a slot
   on another rank's expert skipped.

These are ``kernels/moe.py``'s roundings (transformers' bits, but for the order of each
matmul's fp32 sum). A bias joins the fp32 sum before the projection's one rounding, as
``F.linear``'s does there (transformers' GPT-OSS adds it in the dtype after the matmul);
``swiglu_oai`` is rounded once, where the torch path rounds op by op (see ``activation.py``).
The oracle is ``reference.fused_moe_ref``. No host sync: the grid is sized for the most
blocks there can be, and the unused ones return at once. The tiles are sized by rule, not yet
tuned on a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from actorlm.kernels import moe
from actorlm.kernels.backend import ACTIVATIONS, Experts, check_activation
from actorlm.kernels.triton.activation import gated_activation
from actorlm.kernels.triton.moe_align import align_slots
from actorlm.kernels.triton.norms import round_to

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _Tile(NamedTuple):
    block_m: int  # >= 16: tl.dot's least
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# vLLM's rule: 16-row blocks while the experts average few rows (decode), 64 beyond.
_FEW_ROWS_PER_EXPERT = 16
_SMALL_TILE = _Tile(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)
_LARGE_TILE = _Tile(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)
# The CPU interpreter's cost is per operation, not per element: wide tiles in N and K.
_CPU_TILE = _Tile(block_m=16, block_n=128, block_k=128, num_warps=1, num_stages=1)
_SUM_BLOCK_T, _SUM_BLOCK_H = 16, 256


@triton.jit
def _dot(a, w, acc, DOT_IN_FP32: tl.constexpr):
    # fp32 tiles (ieee: never tf32); 16-bit ones on the interpreter too, which multiplies bf16
    # as raw bits: their products are exact in fp32, as on the tensor cores
    if DOT_IN_FP32:
        acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _expert_matmul_kernel(
    out_ptr,  # [T k, N]: a row per slot
    a_ptr,  # x [T, K] (GATED) or the hidden rows [T k, K]
    w_ptr,  # gate_up [E, 2N, K] (GATED) or down [E, N, K]
    slot_weights_ptr,  # [T k] fp32: the routing weights; read unless GATED
    bias_ptr,  # [E, 2N] (GATED: [gate | up]) or [E, N]; read with HAS_BIAS
    sorted_slots_ptr,  # [num_blocks * BLOCK_M] int32 (moe_align.SlotBlocks)
    block_experts_ptr,  # [num_blocks] int32
    num_slots,
    num_experts,
    N,
    K,
    stride_out,
    stride_a,
    stride_we,
    stride_wn,
    stride_be,
    SLOTS_PER_A_ROW: tl.constexpr,  # top_k when a is x (a token's slots share its row), else 1
    GATED: tl.constexpr,  # gate/up and the activation, else down and the routing weight
    ACTIVATION: tl.constexpr,  # its index in ACTIVATIONS
    HAS_BIAS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:  # past the last expert's rows: the grid is sized for the most
        return
    slots = tl.load(sorted_slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = slots < num_slots  # [BLOCK_M]; the padding holds num_slots
    a_rows = a_ptr + (slots // SLOTS_PER_A_ROW)[:, None] * stride_a  # [BLOCK_M, 1]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_mask = cols < N
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = k < K
        a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]  # [BLOCK_K, BLOCK_N]
        acc = _dot(a, tl.load(w_rows + k[:, None], mask=w_mask, other=0.0), acc, DOT_IN_FP32)
        if GATED:  # the up rows sit N rows below the gate rows
            up = tl.load(w_rows + N * stride_wn + k[:, None], mask=w_mask, other=0.0)
            acc_up = _dot(a, up, acc_up, DOT_IN_FP32)
    if HAS_BIAS:  # in the fp32 sums, before the projections' one rounding
        bias_row = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(bias_row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            bias_up = tl.load(bias_row + N + cols, mask=col_mask, other=0.0)
            acc_up += bias_up.to(tl.float32)[None, :]
    if GATED:
        # each projection rounded to the dtype, as the gate_up matmul's output is
        out = gated_activation(round_to(acc, dtype).to(tl.float32),
                               round_to(acc_up, dtype).to(tl.float32), dtype, ACTIVATION)
    else:
        weight = tl.load(slot_weights_ptr + slots, mask=row_mask, other=0.0)  # [BLOCK_M]
        out = round_to(round_to(acc, dtype).to(tl.float32) * weight[:, None], dtype)
    tl.store(out_ptr + slots[:, None] * stride_out + cols[None, :], out,
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _sum_slots_kernel(
    out_ptr,  # [T, H]
    slot_out_ptr,  # [T k, H]
    slot_experts_ptr,  # [T k] int64: local expert ids, num_experts for another rank's
    num_tokens,
    num_experts,
    H,
    stride_out,
    stride_slot,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BLOCK_T]
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    token_mask = tokens < num_tokens
    col_mask = cols < H
    total = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # slot j: the token's j-th smallest expert
        slots = tokens * TOP_K + j
        expert = tl.load(slot_experts_ptr + slots, mask=token_mask, other=num_experts)
        held = token_mask & (expert < num_experts)  # another rank's slot: never computed here
        value = tl.load(slot_out_ptr + slots[:, None] * stride_slot + cols[None, :],
                        mask=held[:, None] & col_mask[None, :], other=0.0)
        total = round_to(total + value.to(tl.float32), dtype).to(tl.float32)
    tl.store(out_ptr + tokens[:, None] * stride_out + cols[None, :], total.to(dtype),
             mask=token_mask[:, None] & col_mask[None, :])


def _tile(num_slots: int, num_router_experts: int, device: torch.device) -> _Tile:
    if device.type != "cuda":
        return _CPU_TILE
    # the router's experts, not this rank's: every rank picks the same tile
    if num_slots <= _FEW_ROWS_PER_EXPERT * num_router_experts:
        return _SMALL_TILE
    return _LARGE_TILE


def _check_layout(x: torch.Tensor, experts: Experts) -> None:
    assert x.dim() == 2 and x.dtype in _FLOAT_DTYPES, (x.shape, x.dtype)
    assert x.stride(1) == 1, f"x: rows must be contiguous, strides {x.stride()}"
    num_experts, width, hidden = experts.gate_up.shape
    assert hidden == x.shape[1] and width % 2 == 0, \
        f"gate_up: [E, 2I, {x.shape[1]}] wanted, got {tuple(experts.gate_up.shape)}"
    assert experts.down.shape == (num_experts, hidden, width // 2), \
        f"down: [E, H, I] = {(num_experts, hidden, width // 2)} wanted, got {experts.down.shape}"
    for name, weight in (("gate_up", experts.gate_up), ("down", experts.down)):
        assert weight.dtype == x.dtype and weight.device == x.device, \
            f"{name}: {weight.dtype} on {weight.device}, x: {x.dtype} on {x.device}"
        assert weight.stride(2) == 1, f"{name}: rows must be contiguous, strides {weight.stride()}"
    for name, bias, shape in (("gate_up_bias", experts.gate_up_bias, (num_experts, width)),
                              ("down_bias", experts.down_bias, (num_experts, hidden))):
        if bias is None:
            continue
        assert bias.shape == shape and bias.dtype in _FLOAT_DTYPES, \
            f"{name}: {list(shape)} float wanted, got {tuple(bias.shape)} {bias.dtype}"
        assert bias.device == x.device and bias.stride(1) == 1, \
            f"{name}: on {bias.device} (x: {x.device}), strides {bias.stride()}"


def _launch_matmul(out, a, weight, bias, slot_weights, blocks, num_slots, top_k_of_a: int,
                   gated: bool, activation: str, tile: _Tile) -> None:
    """out [T k, N] = per slot, its expert's ``weight`` (gated: gate and up, [E, 2N, K];
    else [E, N, K]) applied to its row of a, plus its ``bias`` ([E, 2N] or [E, N]; None:
    none)."""
    num_experts = weight.shape[0]
    n, k = out.shape[1], a.shape[1]
    block_n = max(16, min(tile.block_n, triton.next_power_of_2(n)))
    block_k = max(16, min(tile.block_k, triton.next_power_of_2(k)))
    grid = (blocks.block_experts.numel(), triton.cdiv(n, block_n))
    _expert_matmul_kernel[grid](
        out, a, weight, slot_weights, weight if bias is None else bias,  # (weight: not read)
        blocks.sorted_slots, blocks.block_experts, num_slots, num_experts, n, k, out.stride(0),
        a.stride(0), weight.stride(0), weight.stride(1), 0 if bias is None else bias.stride(0),
        SLOTS_PER_A_ROW=top_k_of_a,
        GATED=gated,
        ACTIVATION=ACTIVATIONS.index(activation),
        HAS_BIAS=bias is not None,
        DOT_IN_FP32=a.dtype == torch.float32 or a.device.type != "cuda",
        BLOCK_M=tile.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, experts: Experts, top_k: int,
              renormalize: bool) -> torch.Tensor:
    """``KernelBackend.fused_moe``: x [T, H] (stride(1) == 1), router_logits [T, E_router]
    -> [T, H] in x's dtype; ``experts`` stacked in x's dtype and on its device, rows
    contiguous. Their ``gate_up_bias`` [E, 2I] and ``down_bias`` [E, H] (None: no bias), on x's
    device, rows contiguous, join each projection's sum: the down one before the routing
    weight."""
    check_activation(experts.activation)
    _check_layout(x, experts)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return x.new_zeros(x.shape)
    num_experts, inter = experts.gate_up.shape[0], experts.down.shape[2]
    weights, ids = moe.route(router_logits, top_k, renormalize)  # [T, k] each
    ids, by_expert = ids.sort(dim=-1)  # ascending: the order step 3 sums in
    slot_weights = weights.gather(-1, by_expert).flatten()  # [T k] fp32
    slot_experts = ids.flatten() - experts.first_expert  # [T k]: slot s is token s // k's
    held = (slot_experts >= 0) & (slot_experts < num_experts)
    slot_experts = slot_experts.where(held, num_experts)
    num_slots = num_tokens * top_k
    tile = _tile(num_slots, router_logits.shape[1], x.device)
    blocks = align_slots(slot_experts, num_experts, tile.block_m)

    hidden_rows = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)
    _launch_matmul(hidden_rows, x, experts.gate_up, experts.gate_up_bias, slot_weights, blocks,
                   num_slots, top_k, True, experts.activation, tile)
    slot_out = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)
    _launch_matmul(slot_out, hidden_rows, experts.down, experts.down_bias, slot_weights, blocks,
                   num_slots, 1, False, experts.activation, tile)
    out = torch.empty_like(x)
    grid = (triton.cdiv(num_tokens, _SUM_BLOCK_T), triton.cdiv(hidden, _SUM_BLOCK_H))
    _sum_slots_kernel[grid](
        out, slot_out, slot_experts, num_tokens, num_experts, hidden, out.stride(0),
        slot_out.stride(0),
        TOP_K=top_k,
        BLOCK_T=_SUM_BLOCK_T,
        BLOCK_H=_SUM_BLOCK_H,
    )
    return out
