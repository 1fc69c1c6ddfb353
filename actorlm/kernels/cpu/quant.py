"""Linear layers and embedding rows over weights in GGML's block formats (a GGUF file's Q4_0,
Q8_0, Q4_K...), on the C++ kernels of ``csrc/quant.cpp``. For few rows of x (decode) x is
quantized to int8 per block once per call and dotted with the weights' integers straight from
their blocks, as ggml does, so decode reads a fraction of a dense weight's bytes; from a few
dozen rows on (prefill) the weights are dequantized panel by panel into x's dtype for a dense
GEMM tile (with AVX-512; ``QuantLinear.panel_from_rows``). With the VNNI kernels, Q4_0, Q4_1,
Q5_0 and Q8_0 weights are copied at load with 16 rows interleaved (``csrc/quant_interleaved.h``):
one instruction then multiplies 16 rows by x at once, and the panels gather a row's blocks
back (a tied LM head's copy is the embedding's too: ``QuantLinear.rows``).
Those layers keep to integers up to 192 rows in bf16 (48 where the panels run on AMX tiles)
and at every size in fp32, where they are the faster path. On a CPU with AMX tiles, bf16 x of
``_AMX_FROM_ROWS`` rows or more (a long prefill) takes the weight dequantized (for the call
only, in slices of ``_DENSE_SLICE_ROWS`` output rows) through torch's GEMM (oneDNN's AMX
kernels), faster than the panels there. The integers' int8 x costs accuracy
where the reference model is at a near-tie (SmolLM2's first token of "What is the capital
of France?" is "The" by 0.08 nats in fp32 transformers, and the prompt read in int8, as
llama.cpp reads it, turns it to "L"); over a long text the next-token distribution stays
within KL 0.0013 nats of transformers' fp32 (0.0004 with the panels).

``ACTORLM_CPU_ISA=vnni|avx2|scalar`` forces one of the kernels' instruction-set paths (to
compare them; a lesser one than the CPU's best also turns the dense path off, as on a CPU
without AVX-512); by default the best this CPU has runs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Sequence

import gguf
import torch
import torch.nn.functional as F

from actorlm.kernels import portable, resident
from actorlm.kernels.backend import QUANTIZED_FORMATS, QuantizedWeight
from actorlm.kernels.cpu import abi, native

log = logging.getLogger(__name__)

KEPT_TYPES = QUANTIZED_FORMATS
ISAS = ("scalar", "avx2", "vnni")  # the index is the library's isa number
_MAX_PARTS = 8  # csrc/quant.cpp's kMaxParts
# bf16 rows of x from which, on a CPU with AMX tiles, a layer dequantizes its whole weight and
# hands the GEMM to torch (oneDNN's AMX kernels). The dequantized panels run on the tiles too
# (from 48 rows, where they beat the integers): SmolLM2-shaped Q4_1 layers (q/k/v, gate/up,
# down) on a Sapphire Rapids-class Xeon take 1.2, 4.1 and 9.6 ms on the panels at 192, 1,024
# and 1,536 rows against 1.6, 7.1 and 9.0 whole (the dequantizing included)
_AMX_FROM_ROWS = 1536
# output rows of a weight dequantized at once for that GEMM: a larger layer (a 128k-row LM
# head asked for prompt logprobs) goes in slices, so its transient copy stays this many rows
_DENSE_SLICE_ROWS = 8192
_panel_override: int | None = None  # set_panel_from_rows's: every path chosen by it instead


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def _set_isa(name: str, what: str) -> None:
    index = ISAS.index(name) if name in ISAS else -1
    if index < 0 or native.function("actorlm_quant_set_isa")(index) != index:
        has = [isa for i, isa in enumerate(ISAS) if _can_run(i)]
        raise ValueError(f"{what}={name!r}: this CPU and build run {', '.join(has)} "
                         f"(the choices: {', '.join(ISAS)}; CPU flags avx2: "
                         f"{'avx2' in _cpu_flags()}, avx512_vnni: "
                         f"{'avx512_vnni' in _cpu_flags()})")


def _can_run(index: int) -> bool:
    set_isa_fn, current = native.function("actorlm_quant_set_isa"), _isa_index()
    can = set_isa_fn(index) == index
    set_isa_fn(current)
    return can


def _isa_index() -> int:
    return native.function("actorlm_quant_isa")()


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The library, with ``ACTORLM_CPU_ISA`` applied on first use."""
    lib = native.library()
    if lib is not None and os.environ.get("ACTORLM_CPU_ISA"):
        _set_isa(os.environ["ACTORLM_CPU_ISA"].strip(), "ACTORLM_CPU_ISA")
    return lib


def isa() -> str:
    """The instruction-set path the kernels run."""
    _library()
    return ISAS[_isa_index()]


def set_isa(name: str) -> None:
    """Run the kernels on ``name`` (one of ``ISAS``); ValueError where this CPU lacks it."""
    _library()
    _set_isa(name, "isa")


def set_panel_from_rows(rows: int | None) -> None:
    """Run every layer's many-row path from ``rows`` rows of x (to compare the two paths, and
    in tests); None: back to each layer's measured default."""
    global _panel_override
    _library()
    native.function("actorlm_quant_set_panel_from_rows")(rows or 0)
    _panel_override = rows or None


def _amx_from_rows(dtype: torch.dtype) -> int | None:
    """The rows from which bf16 x takes the dequantized weight through torch's GEMM (AMX);
    None: never (no AMX, fp32, a lesser ISA forced, or the paths forced by rows)."""
    if dtype != torch.bfloat16 or _panel_override is not None or not native.has_amx() or \
            _isa_index() != len(ISAS) - 1:
        return None
    return _AMX_FROM_ROWS


def _type_id(type_name: str) -> int:
    if type_name not in KEPT_TYPES:
        raise NotImplementedError(f"GGUF type {type_name} has no CPU kernel (kept: "
                                  f"{', '.join(KEPT_TYPES)})")
    return int(gguf.GGMLQuantizationType[type_name])


def _part(weight: QuantizedWeight, in_features: int) -> tuple[torch.Tensor, object]:
    """The weight's blocks (contiguous uint8) and their ``actorlm_quant_part``."""
    rows, k = weight.shape
    type_id = _type_id(weight.type_name)
    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[weight.type_name]]
    if k != in_features or k % values:
        raise ValueError(f"a {weight.type_name} part of shape {weight.shape}: in_features must "
                         f"be {in_features} and a multiple of {values}")
    blocks = weight.blocks.detach().contiguous().view(torch.uint8).reshape(-1)
    if blocks.numel() != rows * k // values * size:
        raise ValueError(f"{weight.type_name} blocks of {blocks.numel()} bytes for shape "
                         f"{weight.shape}, not {rows * k // values * size}")
    return blocks, abi.STRUCT_TYPES["actorlm_quant_part"](blocks.data_ptr(), type_id, rows)


def _interleaved(blocks: torch.Tensor, part, in_features: int) -> tuple[torch.Tensor, object]:
    """The part with its rows interleaved 16 by 16 for the VNNI kernels (``csrc/
    quant_interleaved.h``: Q4_0, Q4_1, Q5_0 and Q8_0, rows a multiple of 16, the VNNI ISA in
    use), in
    a copy of its own; else the part as it is."""
    if _library() is None:
        return blocks, part
    interleave = native.function("actorlm_quant_interleave")
    if not interleave(part.type, blocks.data_ptr(), part.rows, in_features, None):
        return blocks, part  # (asked first: no copy reserved for a part that keeps its layout)
    copy = resident.empty(blocks.numel())
    interleave(part.type, blocks.data_ptr(), part.rows, in_features, copy.data_ptr())
    return copy, abi.STRUCT_TYPES["actorlm_quant_part"](copy.data_ptr(), part.type, part.rows, 1)


def file_layout(interleaved: torch.Tensor, type_name: str,
                shape: tuple[int, int]) -> QuantizedWeight:
    """The weight of ``shape`` whose interleaved copy is ``interleaved``, its blocks back in the
    file's layout (csrc/quant_interleaved.h's layout undone), for a torch path to dequantize."""
    rows, k = shape
    num_scales = 2 if type_name == "Q4_1" else 1
    num_vectors = 8 if type_name == "Q8_0" else 4
    quants_at = 96 if type_name == "Q5_0" else 32 * num_scales
    groups, blocks = rows // 16, k // 32
    v = interleaved.view(groups, blocks, -1)  # [G, B, the 16 rows' bytes of a block]
    scales = v[..., :32 * num_scales].reshape(groups, blocks, num_scales, 16, 2)
    quants = v[..., quants_at:].reshape(groups, blocks, num_vectors, 16, 4)
    # -> [G, row, B, a block's bytes]: its f16 fields, (Q5_0's qh,) then its quants in order
    fields = [scales.permute(0, 3, 1, 2, 4).reshape(groups, 16, blocks, -1)]
    if type_name == "Q5_0":
        fields.append(_high_bits(v[..., 32:96]).permute(0, 2, 1, 3))
    fields.append(quants.permute(0, 3, 1, 2, 4).reshape(groups, 16, blocks, -1))
    return QuantizedWeight(type_name, torch.cat(fields, dim=-1).reshape(rows, -1), shape)


def _high_bits(masks: torch.Tensor) -> torch.Tensor:
    """Q5_0's eight 64-bit masks of a group's block [G, B, 64 bytes] as its 16 rows' qh,
    [G, B, 16, 4 bytes]: bit 4 i + k of mask s is row i's value 4 s + k."""
    bits = (masks.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [G, B, 64, 8]
    by_row = bits.reshape(*masks.shape[:2], 8, 16, 4).transpose(2, 3)  # [G, B, row, s, k]
    qh = by_row.reshape(*masks.shape[:2], 16, 4, 8).to(torch.int32)  # value 8 byte + bit
    return (qh << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)


class QuantLinear:
    """``x [..., in] -> x @ W.T + bias``, W the rows of ``parts`` stacked (a merged layer whose
    parts came in different formats), on ``csrc/quant.cpp``. ``struct`` is its
    ``actorlm_linear`` for the one-call decode step; it keeps the blocks it points to."""

    max_rows = None  # every batch size runs here

    def __init__(self, parts: Sequence[QuantizedWeight], bias: torch.Tensor | None):
        _library()  # ACTORLM_CPU_ISA applied now: a bad value fails the load, not a step
        if not 1 <= len(parts) <= _MAX_PARTS:
            raise ValueError(f"a quantized linear layer takes 1 to {_MAX_PARTS} parts, not "
                             f"{len(parts)}")
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        # (an interleaved part's own blocks go: the layer holds a weight once)
        built = [_interleaved(*_part(p, self.in_features), self.in_features) for p in parts]
        self._blocks = [blocks for blocks, _ in built]
        # the torch path's weights: the parts themselves, or (interleaved) their type and shape
        self._kept = [None if part.layout else p for p, (_, part) in zip(parts, built)]
        self._kinds = [(p.type_name, p.shape) for p in parts]
        self.interleaved = tuple(bool(part.layout) for _, part in built)  # per part
        self.type_names = tuple(p.type_name for p in parts)
        self._part_array = (abi.STRUCT_TYPES["actorlm_quant_part"] * len(built))(
            *(part for _, part in built))
        self.struct = abi.STRUCT_TYPES["actorlm_linear"](
            None, None if self.bias is None else self.bias.data_ptr(), self.out_features,
            self.in_features, ctypes.cast(self._part_array, ctypes.POINTER(
                abi.STRUCT_TYPES["actorlm_quant_part"])), len(built))
        self._dense: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        suffix = native.dtype_suffix(x.dtype)
        if _library() is None or suffix is None or x.device.type != "cpu":
            return self._torch_path(x)
        rows = x.reshape(-1, self.in_features)  # [M, in], a view where x's layout allows
        amx_from = _amx_from_rows(x.dtype)
        if amx_from is not None and rows.shape[0] >= amx_from:
            return self._dense_gemm(rows).view(*x.shape[:-1], self.out_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = x.new_empty(rows.shape[0], self.out_features)  # [M, out]
        native.function(f"actorlm_quant_linear_{suffix}")(
            ctypes.byref(self.struct), rows.data_ptr(), rows.stride(0), y.data_ptr(),
            rows.shape[0])
        return y.view(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of a one-part layer's weight dequantized to ``dtype`` (an embedding
        lookup, where a tied LM head's layer holds the embedding's blocks), as
        ``dequantize_rows``."""
        (kept,), (blocks,), ((type_name, shape),) = self._kept, self._blocks, self._kinds
        if _library() is None or native.dtype_suffix(dtype) is None:
            return dequantize_rows(kept or file_layout(blocks, type_name, shape), ids, dtype)
        return _rows_of_part(self._part_array[0], shape, ids, dtype, blocks)

    def dequantized(self, dtype: torch.dtype, start: int = 0, end: int | None = None
                    ) -> torch.Tensor:
        """The weight's output rows [start, end) (all by default) in ``dtype``, [rows, in],
        dequantized now (not kept: a dense copy would take a dense model's memory)."""
        end = self.out_features if end is None else end
        out = torch.empty(end - start, self.in_features, dtype=dtype)
        first = 0  # the part's first row in the layer
        for part, blocks, (_, shape) in zip(self._part_array, self._blocks, self._kinds):
            low, high = max(start, first), min(end, first + shape[0])
            if low < high:
                _rows_of_part(part, shape, torch.arange(low - first, high - first), dtype,
                              blocks, out=out[low - start:high - start])
            first += shape[0]
        return out

    def _dense_gemm(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` through torch's GEMM on the weight dequantized, ``_DENSE_SLICE_ROWS`` output
        rows at a time."""
        bias = None if self.bias is None else self.bias.to(rows.dtype)
        if self.out_features <= _DENSE_SLICE_ROWS:
            return F.linear(rows, self.dequantized(rows.dtype), bias)
        y = rows.new_empty(rows.shape[0], self.out_features)
        for start in range(0, self.out_features, _DENSE_SLICE_ROWS):
            end = min(start + _DENSE_SLICE_ROWS, self.out_features)
            y[:, start:end] = F.linear(rows, self.dequantized(rows.dtype, start, end),
                                       None if bias is None else bias[start:end])
        return y

    def panel_from_rows(self, dtype: torch.dtype) -> int | None:
        """The rows of x from which this layer runs in ``dtype`` on its weight dequantized (in
        dense tiles over panels of it, ``csrc/quant_panel.h``; or whole, through torch's GEMM
        on a CPU with AMX) instead of integer dot products; None: never (no AVX-512, a lesser
        ISA forced, or no library)."""
        if _library() is None:
            return None
        rows = native.function("actorlm_quant_panel_from_rows")(
            ctypes.byref(self.struct), int(dtype == torch.bfloat16)) or None
        amx_from = _amx_from_rows(dtype)
        return rows if amx_from is None or rows is None else min(rows, amx_from)

    def _torch_path(self, x: torch.Tensor) -> torch.Tensor:
        # Without the library: the weight dequantized once per dtype and kept (as large as a
        # dense model's, and slower than the kernels: correct only, a stopgap).
        if x.dtype not in self._dense:
            parts = [kept or file_layout(blocks, *kind)
                     for kept, blocks, kind in zip(self._kept, self._blocks, self._kinds)]
            if not self._dense:
                log.warning("no C++ CPU kernels for %s: a quantized layer %s runs dequantized "
                            "with F.linear (slower, and its memory as a dense layer's)", x.dtype,
                            [p.type_name for p in parts])
            self._dense[x.dtype] = torch.cat([portable.dequantize(p, x.dtype) for p in parts])
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self._dense[x.dtype].to(x.device), bias)


def dequantize_rows(weight: QuantizedWeight, rows: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """``weight``'s rows ``rows`` (an embedding lookup) dequantized to ``dtype``, [*rows.shape,
    in_features], as gguf.quants dequantizes them (then rounded once to ``dtype``)."""
    in_features = weight.shape[1]
    if _library() is None or native.dtype_suffix(dtype) is None:
        picked = weight.blocks.contiguous().view(torch.uint8).reshape(weight.shape[0], -1)
        picked = picked[rows.reshape(-1).long().cpu()]
        values = portable.dequantize(QuantizedWeight(weight.type_name, picked,
                                                     (picked.shape[0], in_features)), dtype)
        return values.reshape(*rows.shape, in_features)
    blocks, part = _part(weight, in_features)
    return _rows_of_part(part, weight.shape, rows, dtype, blocks)


def _rows_of_part(part, shape: tuple[int, int], rows: torch.Tensor, dtype: torch.dtype,
                  blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``rows`` of the part (``blocks`` its memory, kept alive until the call returns),
    into ``out`` ([rows, in], contiguous) if given."""
    ids = rows.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < shape[0]):
        raise IndexError(f"row ids out of range [0, {shape[0]})")
    if out is None:
        out = torch.empty(ids.numel(), shape[1], dtype=dtype)
    native.function(f"actorlm_quant_dequantize_rows_{native.dtype_suffix(dtype)}")(
        ctypes.byref(part), shape[1], ids.data_ptr(), ids.numel(), out.data_ptr())
    del blocks
    return out.view(*rows.shape, shape[1])
