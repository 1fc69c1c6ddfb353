"""Linear layers on a CPU over weights laid out once for the GEMM that runs them.

``F.linear`` hands oneDNN (bf16) or MKL (fp32) a plain-layout weight on every call. A weight
reordered once runs faster where it matters:

- bf16: oneDNN's own blocked layout, the same bits as ``F.linear``, 25-50 % faster at every
  batch size measured (1 to 2,048 rows, SmolLM2 shapes, AMX machine). Where the CPU has
  avx512_bf16, one or two rows run on the C++ panel GEMM below instead (at one row it reads the
  weights at 1.6x oneDNN's speed), within one bf16 ulp of oneDNN's result.
- fp32: MKL's GEMM falls off a cliff between 2 and ~32 rows (16 rows of SmolLM2's layers take
  3x the time of one row, where they should cost little more than reading the weights once),
  and oneDNN's packed GEMM still computes and reads memory in turn rather than at once. With
  AVX-512 the C++ kernel of ``csrc/linear.cpp`` runs instead (panels of 64 columns, the
  next panel prefetched while a tile of rows computes on this one): on SmolLM2's 30 layers and
  LM head, 16 rows take 0.75x oneDNN's time and 64 rows 0.85x, and one or two rows 0.9x and
  0.85x MKL's GEMV. With AVX2 and FMA alone (panels of 32 columns, tiles of 3 rows) it runs
  up to 16 rows: on a Zen 3, 1 row takes 0.65-1.0x MKL's time, 2 to 8 rows 0.25-0.6x, 16 rows
  0.55-0.95x. Beyond, and on a CPU without either, MKL's GEMV runs below three rows, oneDNN's
  packed GEMM up to 128 (2x MKL's speed at 17 rows, 1.3x at 64, even at 128), and MKL's GEMM
  above (1.1x oneDNN's speed from 256 rows). oneDNN keeps memory for every row count it has
  seen (~1 MiB a count over SmolLM2's four layer shapes, not the primitive cache's alone: it
  stays with that cache off), and a batch of prompts of each length is a new count: a server
  grew by 400 MiB over 10,000 requests. So its rows are rounded up to a multiple of 8, sixteen
  counts in all (17 rows then take 1.3x their own count's time, still 0.75x MKL's).
  Either GEMM moves the last bits of the result against MKL (transformers' bits): greedy
  tokens stay within vLLM's ``check_logprobs_close`` rule.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from actorlm.kernels.cpu import native

# fp32 rows on oneDNN's packed GEMM: from 3 (below, MKL's GEMV is faster) to 128 (above, MKL's
# GEMM is as fast or faster and keeps nothing per row count), rounded up to a multiple of 8
_ONEDNN_FP32_ROWS, _ONEDNN_FP32_ROW_STEP = range(3, 129), 8


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable | None:
    """``x -> F.linear(x, weight, bias)`` over a copy of ``weight`` packed for a faster GEMM, or
    None where packing does not apply (not a CPU, not fp32 or bf16, no oneDNN support)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    bias = None if bias is None else bias.detach()
    if weight.dtype == torch.float32:
        plain = weight.detach()
        packed = _onednn_linear(plain, bias)
        wide = None if packed is None else functools.partial(_fp32_rows, plain, bias, packed)
        return PanelLinear.build(plain, bias, wide=wide) or wide
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    wide = _onednn_linear(weight.detach(), bias)
    if wide is None:
        return None
    # up to two rows on the panel GEMM where the CPU has avx512_bf16, beyond on oneDNN's AMX
    return PanelLinear.build(weight.detach(), bias, wide=wide) or wide


def _fp32_rows(weight: torch.Tensor, bias: torch.Tensor | None, packed: Callable,
               x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on MKL, or on oneDNN's ``packed`` GEMM over ``x``'s rows
    padded to a multiple of 8 where oneDNN is the faster (see the module's docstring)."""
    rows = x.shape[0]
    if rows not in _ONEDNN_FP32_ROWS:
        return F.linear(x, weight, bias)
    padded = -(-rows // _ONEDNN_FP32_ROW_STEP) * _ONEDNN_FP32_ROW_STEP
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    return packed(x)[:rows]


def amx_tiles(on: bool | None = None) -> bool | None:
    """Whether the bf16 panel GEMM runs on AMX tiles where k is a multiple of 32 (from 3 rows;
    the routed experts' at every row count), after choosing ``on`` if given (tests compare the
    two paths); None where this CPU, the build or the kernel gives no tiles."""
    fn = native.function("actorlm_linear_amx")
    state = -1 if fn is None else fn(-1 if on is None else int(on))
    return None if state < 0 else bool(state)


def _onednn_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable | None:
    if not torch.backends.mkldnn.is_available():
        return None
    # The batch size is only a layout hint; every batch size runs on the packed weight.
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PlainLinear:
    """``F.linear`` over the weight as it is: where no packing applies."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PanelLinear:
    """``x [..., k] -> x @ weight.T + bias`` through ``csrc/linear.cpp`` for up to
    ``max_rows`` rows (None: any number), ``wide`` taking more: ``packed`` is the weight in
    panels, ``padded_bias`` the bias in fp32, zero-padded to the panels' columns (or None). It
    keeps no reference to the plain weight, which its layer may then let go."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: _Kernel,
                 wide: Callable | None = None):
        self.kernel, self.wide, self.dtype = kernel, wide, weight.dtype
        self.out_features, self.in_features = n, k = weight.shape
        self.max_rows = _AMX_MAX_ROWS if on_amx_tiles(weight.dtype, k) else kernel.max_rows
        columns = -(-n // kernel.panel) * kernel.panel
        self.packed = aligned_empty(packed_numel(n, k, weight.dtype, kernel), weight.dtype)
        kernel.pack(weight.data_ptr(), self.packed.data_ptr(), n, k)
        self.padded_bias = None
        if bias is not None:
            self.padded_bias = torch.zeros(columns)
            self.padded_bias[:n] = bias.float()

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None,
              wide: Callable | None = None) -> PanelLinear | None:
        """The packed layer, or None where the kernel for its dtype is not built here (or it
        takes only some rows and no ``wide`` GEMM is given for the others)."""
        kernel = _kernel(weight.dtype)
        if kernel is None or not weight.is_contiguous() or \
                (kernel.max_rows is not None and wide is None):
            return None
        return cls(weight, bias, kernel, wide)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"a {self.dtype} linear layer got a {x.dtype} input")
        if x.dim() != 2 or x.stride(-1) != 1:  # [..., k] of any layout, as F.linear takes it
            rows = x.reshape(-1, self.in_features).contiguous()
            return self(rows).view(*x.shape[:-1], self.out_features)
        if self.max_rows is not None and x.shape[0] > self.max_rows:
            return self.wide(x)
        y = x.new_empty(x.shape[0], self.out_features)
        self.kernel.run(x.data_ptr(), x.stride(0), self.packed.data_ptr(),
                        None if self.padded_bias is None else self.padded_bias.data_ptr(),
                        y.data_ptr(), x.shape[0], self.out_features, self.in_features)
        return y


# rows up to which the panel GEMM runs: bf16, two (oneDNN's AMX GEMM is faster from a few rows
# on); fp32, every count with AVX-512's 64-column panels, 16 with AVX2's 32-column ones
_BF16_MAX_ROWS = 2
_AVX2_PANEL, _AVX2_MAX_ROWS = 32, 16
# bf16 on AMX tiles (in_features a multiple of 32, from 3 rows): up to 64, where the panels beat
# oneDNN's AMX GEMM on its own layout (SmolLM2's layers, its LM head and the test MoE's
# attention: 1.1-1.7x its speed at 3-32 rows, 0.98-1.3x at 64, 0.8-1.0x at 128; Xeon with AMX,
# 2 cores, the weights from memory)
_AMX_MAX_ROWS = 64


def on_amx_tiles(dtype: torch.dtype, in_features: int) -> bool:
    """Whether the panels of a layer run on AMX tiles (from 3 rows; the experts' at any)."""
    return dtype == torch.bfloat16 and in_features % 32 == 0 and bool(amx_tiles())


class _Kernel:
    def __init__(self, suffix: str):
        self.panel = native.function(f"actorlm_linear_panel_{suffix}")()
        self.max_rows = _BF16_MAX_ROWS if suffix == "bf16" else \
            _AVX2_MAX_ROWS if self.panel == _AVX2_PANEL else None
        self.pack = native.function(f"actorlm_linear_pack_{suffix}")
        self.unpack = native.function(f"actorlm_linear_unpack_{suffix}")  # pack undone
        self.run = native.function(f"actorlm_linear_{suffix}")
        # each row the same whatever the rows beside it (the routed experts', csrc/moe.cpp)
        self.rowwise = native.function(f"actorlm_linear_rowwise_{suffix}")


@functools.cache
def _kernel(dtype: torch.dtype = torch.float32) -> _Kernel | None:
    """The panel GEMM for ``dtype`` (fp32 or bf16), or None where this build has none."""
    suffix = native.dtype_suffix(dtype)
    kernel = None if native.library() is None or suffix is None else _Kernel(suffix)
    return kernel if kernel is not None and kernel.panel > 0 else None


def packed_numel(n: int, k: int, dtype: torch.dtype, kernel: _Kernel) -> int:
    """Values of an [n, k] weight in panels: columns rounded up to the panel, k to a 32-bit
    lane's values (a multiple of the panel's 64 bytes, so packed weights laid end to end stay
    aligned)."""
    depth = 4 // torch.empty((), dtype=dtype).element_size()  # values of k a lane holds
    return -(-n // kernel.panel) * kernel.panel * -(-k // depth) * depth


def aligned_empty(numel: int, dtype: torch.dtype, alignment: int = 64) -> torch.Tensor:
    """A tensor of ``numel`` whose data starts on an ``alignment``-byte boundary."""
    size = torch.empty((), dtype=dtype).element_size()
    spare = torch.empty(numel + alignment // size, dtype=dtype)
    skip = (-spare.data_ptr() % alignment) // size
    return spare[skip:skip + numel]
