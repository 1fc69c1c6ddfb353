"""Linear layers on a CPU over weights laid out once for oneDNN.

``F.linear`` hands oneDNN (bf16) or MKL (fp32) a plain-layout weight on every call. A weight
reordered once into oneDNN's own blocked layout runs faster where it matters:

- bf16: the same bits as ``F.linear``, 25-50 % faster at every batch size measured (1 to 2,048
  rows, SmolLM2 shapes, AMX machine). The packed copy is used for every call.
- fp32: MKL's GEMM falls off a cliff between 2 and ~32 rows (16 rows of SmolLM2's layers take
  3x the time of one row, where they should cost little more than reading the weights once);
  oneDNN's packed GEMM takes 30-40 % less there. At one or two rows MKL is faster (a GEMV), so
  those stay on ``F.linear``. oneDNN moves the last bits of the result against MKL (and so
  against transformers): greedy tokens stay within vLLM's ``check_logprobs_close`` rule.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

_FP32_PACKED_FROM_ROWS = 3  # at 1-2 rows MKL's GEMV beats oneDNN's packed GEMM


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable | None:
    """``x -> F.linear(x, weight, bias)`` over a copy of ``weight`` packed for oneDNN, or None
    where packing does not apply (not a CPU, not fp32 or bf16, no oneDNN support)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    if weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    # The batch size is only a layout hint; every batch size runs on the packed weight.
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
    bias = None if bias is None else bias.detach()

    def linear(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    if weight.dtype == torch.bfloat16:
        return linear
    plain = weight.detach()

    def fp32_linear(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < _FP32_PACKED_FROM_ROWS:
            return F.linear(x, plain, bias)
        return linear(x)

    return fp32_linear
