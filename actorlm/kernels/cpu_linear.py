"""Linear layers on a CPU over weights laid out once for the GEMM that runs them.

``F.linear`` hands oneDNN (bf16) or MKL (fp32) a plain-layout weight on every call. A weight
reordered once runs faster where it matters:

- bf16: oneDNN's own blocked layout, the same bits as ``F.linear``, 25-50 % faster at every
  batch size measured (1 to 2,048 rows, SmolLM2 shapes, AMX machine).
- fp32: MKL's GEMM falls off a cliff between 2 and ~32 rows (16 rows of SmolLM2's layers take
  3x the time of one row, where they should cost little more than reading the weights once),
  and oneDNN's packed GEMM still computes and reads memory in turn rather than at once. With
  AVX-512 the C++ kernel of ``csrc/cpu_linear.cpp`` runs instead (panels of 64 columns, the
  next panel prefetched while a tile of rows computes on this one): on SmolLM2's 30 layers and
  LM head, 16 rows take 0.75x oneDNN's time and 64 rows 0.85x, and one or two rows 0.9x and
  0.85x MKL's GEMV. Without AVX-512, oneDNN's packed GEMM from three rows and MKL's GEMV below.
  Either GEMM moves the last bits of the result against MKL (transformers' bits): greedy
  tokens stay within vLLM's ``check_logprobs_close`` rule.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable

import torch
import torch.nn.functional as F

from actorlm.kernels import native

_ONEDNN_FP32_FROM_ROWS = 3  # below, MKL's GEMV is faster than oneDNN's packed fp32 GEMM


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable | None:
    """``x -> F.linear(x, weight, bias)`` over a copy of ``weight`` packed for a faster GEMM, or
    None where packing does not apply (not a CPU, not fp32 or bf16, no oneDNN support)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    bias = None if bias is None else bias.detach()
    if weight.dtype == torch.float32:
        plain = weight.detach()
        panel = PanelLinear.build(plain, bias)
        if panel is not None:
            return panel
        packed = _onednn_linear(plain, bias)
        if packed is None:
            return None
        return lambda x: (F.linear(x, plain, bias) if x.shape[0] < _ONEDNN_FP32_FROM_ROWS
                          else packed(x))
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return _onednn_linear(weight.detach(), bias)


def _onednn_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable | None:
    if not torch.backends.mkldnn.is_available():
        return None
    # The batch size is only a layout hint; every batch size runs on the packed weight.
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PanelLinear:
    """fp32 ``x [..., k] -> x @ weight.T + bias`` through ``csrc/cpu_linear.cpp``: ``packed`` is
    the weight in panels, ``padded_bias`` the bias zero-padded to the panels' columns (or None).
    It keeps no reference to the plain weight, which its layer may then let go."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: _Kernel):
        self.kernel = kernel
        self.out_features, self.in_features = n, k = weight.shape
        columns = -(-n // kernel.panel) * kernel.panel
        self.packed = _aligned_empty(columns * k)
        kernel.pack(weight.data_ptr(), self.packed.data_ptr(), n, k)
        self.padded_bias = None
        if bias is not None:
            self.padded_bias = torch.zeros(columns)
            self.padded_bias[:n] = bias.float()

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> PanelLinear | None:
        """The packed layer, or None where the kernel is not built here."""
        kernel = _kernel()
        if kernel is None or not weight.is_contiguous():
            return None
        return cls(weight, bias, kernel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"an fp32 linear layer got a {x.dtype} input")
        if x.dim() != 2 or x.stride(-1) != 1:  # [..., k] of any layout, as F.linear takes it
            rows = x.reshape(-1, self.in_features).contiguous()
            return self(rows).view(*x.shape[:-1], self.out_features)
        y = x.new_empty(x.shape[0], self.out_features)
        self.kernel.run(x.data_ptr(), x.stride(0), self.packed.data_ptr(),
                        None if self.padded_bias is None else self.padded_bias.data_ptr(),
                        y.data_ptr(), x.shape[0], self.out_features, self.in_features)
        return y


class _Kernel:
    def __init__(self, cdll: ctypes.CDLL):
        P, I64 = ctypes.c_void_p, ctypes.c_int64
        self.panel = cdll.actorlm_linear_panel_f32()
        self.pack = native.function("actorlm_linear_pack_f32", [P, P, I64, I64])
        self.run = native.function("actorlm_linear_f32", [P, I64, P, P, P, I64, I64, I64])


@functools.cache
def _kernel() -> _Kernel | None:
    cdll = native.library()
    kernel = None if cdll is None else _Kernel(cdll)
    return kernel if kernel is not None and kernel.panel > 0 else None


def _aligned_empty(numel: int, alignment: int = 64) -> torch.Tensor:
    """An fp32 tensor of ``numel`` whose data starts on an ``alignment``-byte boundary."""
    spare = torch.empty(numel + alignment // 4)
    skip = (-spare.data_ptr() % alignment) // 4
    return spare[skip:skip + numel]
