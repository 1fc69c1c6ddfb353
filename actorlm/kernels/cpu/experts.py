"""Routed experts on the panel GEMM (``csrc/moe.cpp``): the CPU wing's ``fused_moe`` for
experts prepared at load (``prepare_experts``).

``F.linear`` over a bf16 expert at one row reads its weights at about half the speed of
``csrc/linear.cpp``'s panels, and the torch path adds some twenty small ops a layer. Here each
expert's gate/up [2I, H] and down [H, I] are packed once, as ``PanelLinear`` packs a weight
(fp32 with AVX-512 or AVX2 and FMA, bf16 with avx512_bf16; elsewhere the experts stay as they
came and ``kernels/moe.py`` runs them), and one call routes a step's rows and runs their
experts. (With AVX2 every row runs on the panels, past the 16 a ``PanelLinear`` takes: a large
prefill's experts cost somewhat more than on the torch path there, docs/benchmarks.md.)

Routing is C++ too, so that a layer routes alike on this path and inside the one-call decode
step (``decode_step.py``): the same top-k as ``moe.route`` (fp32 softmax, then the highest
probabilities; torch.topk leaves the order of ties to its implementation, here the lower
index wins), the weights within an fp32 rounding of its (exp and the sum differ in order).
Given the same routing, the experts' results are ``moe.grouped_experts``' roundings over the
panel GEMM's bits (which differ from ``F.linear``'s in the order of the sums), a rank's share
of the experts (expert parallelism) included: the slots on the others add nothing.
"""

from __future__ import annotations

import torch

from actorlm.kernels.backend import ACTIVATIONS, Experts, check_activation
from actorlm.kernels.cpu import abi, linear, native

_ExpertsStruct = abi.STRUCT_TYPES["actorlm_experts"]


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
        (or they are not contiguous CPU tensors of its shapes)."""
        gate_up, down = experts.gate_up, experts.down
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
        out = torch.empty_like(x)
        if x.shape[0]:
            self._experts(self.struct, x.data_ptr(), ids.data_ptr(), weights.data_ptr(),
                          out.data_ptr(), x.shape[0], ids.shape[1])
        return out


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
