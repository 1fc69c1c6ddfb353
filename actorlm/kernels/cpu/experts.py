"""Routed experts on the panel GEMM (``csrc/moe.cpp``): the CPU wing's ``fused_moe`` for
experts prepared at load (``prepare_experts``).

``F.linear`` over a bf16 expert at one row reads its weights at about half the speed of
``csrc/linear.cpp``'s panels, and the torch path adds some twenty small ops a layer. Here each
expert's gate/up [2I, H] and down [H, I] are packed once, as ``PanelLinear`` packs a weight
(fp32 with AVX-512 or AVX2 and FMA, bf16 with avx512_bf16; elsewhere the experts stay as they
came and ``kernels/moe.py`` runs them), and one call routes a step's rows and runs their
experts. (With AVX2 every row runs on the panels, past the 16 a ``PanelLinear`` takes: a large
prefill's experts cost somewhat more than on the torch path there, docs/benchmarks.md.)

On a CPU with AMX tiles the panels run on them (``csrc/linear.cpp``) where both projections'
depth (hidden, intermediate) is a multiple of 32: a prefill's many rows an expert too, at 2-5x
the speed of the path below (16 experts of hidden and width 1,024, top 2: 128 to 2,048 tokens
3.4-18 against 18-42 ms). Other shapes keep the panels on the AVX-512 tile, and there large bf16
steps (a prefill: ``_AMX_FROM_EXPERT_ROWS`` rows an expert on average) run
``moe.grouped_experts`` instead, each expert's projections unpacked from the panels for the call
(the same bits as the weights loaded) and multiplied by torch's GEMM, which runs on the tiles:
1.9x faster at 128 rows an expert and 3.2x at 256, the unpacking included.

Routing is C++ too, so that a layer routes alike on this path and inside the one-call decode
step (``decode_step.py``): the same top-k as ``moe.route`` (fp32 softmax, then the highest
probabilities; torch.topk leaves the order of ties to its implementation, here the lower
index wins), the weights within an fp32 rounding of its (exp and the sum differ in order).
Given the same routing, the experts' results are ``moe.grouped_experts``' roundings over the
panel GEMM's bits (which differ from ``F.linear``'s in the order of the sums), a rank's share
of the experts (expert parallelism) included: the slots on the others add nothing.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F

from actorlm.kernels import moe
from actorlm.kernels.backend import ACTIVATIONS, Experts, check_activation
from actorlm.kernels.cpu import abi, fused, linear, native

_ExpertsStruct = abi.STRUCT_TYPES["actorlm_experts"]
# Rows an expert gets on average (tokens x top_k / experts) from which, in bf16 on a CPU with
# AMX tiles, a step's experts whose panels cannot run on the tiles themselves run on torch's
# GEMM (oneDNN's AMX kernels), each projection unpacked from its panels for the call. Measured
# (before the panels ran on the tiles) with 16 experts of hidden and width 1,024, top 2, on a
# Sapphire Rapids-class Xeon: the panels against the unpacked weights 15.0 against
# 20.3 ms at 32 rows an expert (256 tokens), 29.0 against 24.1 at 64, 57.6 against 30.0 at
# 128, 115 against 36 at 256: the unpacking (a read and a write of every weight) is paid once,
# the GEMM's gain grows with the rows.
_AMX_FROM_EXPERT_ROWS = 48


class PanelExperts:
    """A layer's experts packed for the panel GEMM: ``gate_up`` and ``down`` hold every
    expert's panels end to end (``*_stride`` values apart), ``struct`` describes them to the
    C++ side. It keeps no reference to the stacked weights, which the layer may then let go."""

    def __init__(self, experts: Experts, kernel):
        check_activation(experts.activation)
        self.num_experts, two_inter, self.hidden = experts.gate_up.shape
        self.first_expert = experts.first_expert  # the router's id of the first
        self.intermediate = two_inter // 2
        self.dtype, self.activation = experts.gate_up.dtype, experts.activation
        self._kernel = kernel
        self.gate_up, self.gate_up_stride = _pack_each(experts.gate_up, kernel)
        self.down, self.down_stride = _pack_each(experts.down, kernel)
        self.struct = _ExpertsStruct(
            self.gate_up.data_ptr(), self.down.data_ptr(), self.gate_up_stride,
            self.down_stride, self.hidden, self.intermediate, self.num_experts,
            ACTIVATIONS.index(self.activation), self.first_expert)
        suffix = native.dtype_suffix(self.dtype)
        self._experts = native.function(f"actorlm_moe_experts_{suffix}")

    @classmethod
    def build(cls, experts: Experts) -> PanelExperts | None:
        """The packed experts, or None where the panel GEMM for their dtype is not built here
        (or they are not contiguous CPU tensors of its shapes, or have biases: GPT-OSS's, which
        its C++ does not add)."""
        gate_up, down = experts.gate_up, experts.down
        if experts.gate_up_bias is not None or experts.down_bias is not None:
            return None
        if gate_up.device.type != "cpu" or not gate_up.is_contiguous() or \
                not down.is_contiguous() or down.dtype != gate_up.dtype:
            return None
        kernel = linear._kernel(gate_up.dtype)
        if kernel is None or native.function("actorlm_moe_experts_f32") is None:
            return None
        return cls(experts, kernel)

    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> torch.Tensor:
        """``KernelBackend.fused_moe``: x [T, H], router_logits [T, E] -> [T, H]."""
        if x.dtype != self.dtype:
            raise TypeError(f"{self.dtype} experts got a {x.dtype} input")
        weights, ids = route(router_logits, top_k, renormalize)
        return self.run(x, weights, ids)

    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over j of weights[t, j] * expert ids[t, j] (x[t]), over the experts held here:
        x [T, H], weights [T, k] fp32, ids [T, k] int64 (the router's ids) -> [T, H]."""
        x = x.contiguous()
        weights, ids = weights.float().contiguous(), ids.to(torch.int64).contiguous()
        if self._on_amx(ids.numel()):
            return moe.grouped_experts(x, weights, ids, _Unpacked(self), fused.act_and_mul)
        out = torch.empty_like(x)
        if x.shape[0]:
            self._experts(self.struct, x.data_ptr(), ids.data_ptr(), weights.data_ptr(),
                          out.data_ptr(), x.shape[0], ids.shape[1])
        return out

    def _on_amx(self, num_slots: int) -> bool:
        """Whether torch's GEMM on the tiles runs the step over unpacked weights: a large bf16
        step whose panels cannot run on the tiles themselves."""
        return self.dtype == torch.bfloat16 and native.has_amx() and \
            num_slots >= _AMX_FROM_EXPERT_ROWS * self.num_experts and \
            not all(linear.on_amx_tiles(self.dtype, depth)
                    for depth in (self.hidden, self.intermediate))

    def unpacked_linear(self, projection: str, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """rows @ expert ``expert``'s ``projection`` ("gate_up" or "down").T over its weight
        unpacked from the panels (into a buffer that the next such call reuses)."""
        if projection == "gate_up":
            packed, stride, n, k = self.gate_up, self.gate_up_stride, 2 * self.intermediate, \
                self.hidden
        else:
            packed, stride, n, k = self.down, self.down_stride, self.hidden, self.intermediate
        weight = _scratch(n, k, self.dtype)
        self._kernel.unpack(packed[expert * stride:].data_ptr(), weight.data_ptr(), n, k)
        return F.linear(rows, weight)


class _Unpacked:
    """PanelExperts as ``moe.grouped_experts`` takes them: each expert's projections
    callables that unpack their weight when their rows come."""

    def __init__(self, experts: PanelExperts):
        self.activation, self.first_expert = experts.activation, experts.first_expert
        self.gate_up_bias = self.down_bias = None
        ids = range(experts.num_experts)
        self.gate_up = [functools.partial(experts.unpacked_linear, "gate_up", e) for e in ids]
        self.down = [functools.partial(experts.unpacked_linear, "down", e) for e in ids]


_buffers = threading.local()


def _scratch(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """An [n, k] buffer of this thread's, one per shape (two engines' steps in one process
    run on threads of their own)."""
    buffers = _buffers.__dict__.setdefault("by_shape", {})
    if (n, k, dtype) not in buffers:
        buffers[n, k, dtype] = torch.empty(n, k, dtype=dtype)
    return buffers[n, k, dtype]


def route(router_logits: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe.route`` in one C++ pass: (weights [T, k] fp32, ids [T, k] int64), highest
    first, a tie to the lower index."""
    logits = router_logits.contiguous()
    if native.dtype_suffix(logits.dtype) is None:
        logits = logits.float()
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    if num_tokens:
        native.function(f"actorlm_moe_route_{native.dtype_suffix(logits.dtype)}")(
            logits.data_ptr(), num_tokens, num_experts, top_k, int(renormalize),
            ids.data_ptr(), weights.data_ptr())
    return weights, ids


def _pack_each(stacked: torch.Tensor, kernel) -> tuple[torch.Tensor, int]:
    """stacked [E, n, k] -> (every expert's panels end to end, the values between two)."""
    num_experts, n, k = stacked.shape
    stride = linear.packed_numel(n, k, stacked.dtype, kernel)
    packed = linear.aligned_empty(num_experts * stride, stacked.dtype)
    for expert in range(num_experts):
        kernel.pack(stacked[expert].data_ptr(), packed[expert * stride:].data_ptr(), n, k)
    return packed, stride
