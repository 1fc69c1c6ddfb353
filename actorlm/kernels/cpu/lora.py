"""LoRA deltas of a mixed batch on a CPU (``csrc/lora.cpp``): the kernel the one-call decode
step runs for its rows with an adapter, here for the Python layers too, so the two paths give
the same bits.

Rows are walked one slot's group at a time, up to four rows per read of A and B (AVX-512, with
its bf16 dot products where the CPU has them, or a portable path: ``set_isa``); that beats
torch's gather, two GEMMs and scatter per group (a dispatch each, and for bf16 copies through
fp32) for a decode step's rows, and loses to the GEMMs for a long prefill, which takes
``kernels.lora``'s torch path beyond ``MAX_ROWS`` rows with an adapter.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from actorlm.kernels import lora
from actorlm.kernels.cpu import abi, native

LoRAStruct = abi.STRUCT_TYPES["actorlm_lora"]
ISAS = ("portable", "avx512")  # the index is the library's isa number
# rows of one adapter where torch catches up (SmolLM2's layers: even at 256, ahead at 512)
MAX_ROWS = 256


def add_lora(y: torch.Tensor, x: torch.Tensor, table: lora.LoRATable,
             mapping: lora.LoRAMapping) -> torch.Tensor:
    """``kernels.lora.add_lora`` (same arguments), on the C++ kernel where it takes them."""
    fn = _function(y, x, table, mapping)
    if fn is None:
        return lora.add_lora(y, x, table, mapping)
    fn(ctypes.byref(table_struct(table)), x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0),
       x.shape[0], x.shape[1], y.shape[1], mapping.token_slots.data_ptr())
    return y


def isa() -> str | None:
    """The path the kernel runs (None without the library)."""
    fn = native.function("actorlm_lora_isa")
    return None if fn is None else ISAS[fn()]


def set_isa(name: str) -> bool:
    """Run the kernel's ``name`` path from now on (for tests); False, with nothing changed,
    where this CPU or build lacks it."""
    fn = native.function("actorlm_lora_set_isa")
    return fn is not None and fn(ISAS.index(name)) >= 0


def table_fits(table: lora.LoRATable, in_features: int, out_features: int,
               dtype: torch.dtype) -> bool:
    """Whether the kernel reads ``table`` for a layer of these features in ``dtype``:
    contiguous, shaped for the layer, the rank split evenly over the parts."""
    a, b, parts = table
    return a.dtype == b.dtype == dtype and a.is_contiguous() and b.is_contiguous() and \
        a.shape[1:] == (table.rank, in_features) and \
        b.shape == (a.shape[0], table.rank, out_features) and \
        bool(parts) and sum(parts) == out_features and table.rank % len(parts) == 0


def table_struct(table: lora.LoRATable) -> LoRAStruct:
    """The kernel's view of ``table`` (it points into the table's tensors: keep them)."""
    return LoRAStruct(table.a.data_ptr(), table.b.data_ptr(), table.rank,
                      len(table.out_parts), _part_ends(table.out_parts).data_ptr())


@functools.cache
def _part_ends(out_parts: tuple[int, ...]) -> torch.Tensor:
    """Where each part's output rows end, [parts] int64 (kept: the kernel reads it)."""
    return torch.tensor(out_parts, dtype=torch.int64).cumsum(0)


def _function(y, x, table: lora.LoRATable, mapping: lora.LoRAMapping):
    """The C++ function for these tensors, or None where it does not take them."""
    slots = mapping.token_slots
    suffix = native.dtype_suffix(y.dtype)
    if suffix is None or slots is None or y.device.type != "cpu" or y.dim() != 2 or \
            x.dim() != 2 or x.shape[0] != y.shape[0] or slots.shape != (x.shape[0],) or \
            x.shape[0] > MAX_ROWS or slots.dtype != torch.int32 or x.dtype != y.dtype or \
            not slots.is_contiguous() or x.stride(1) != 1 or y.stride(1) != 1 or \
            not table_fits(table, x.shape[1], y.shape[1], y.dtype):
        return None
    return native.function(f"actorlm_lora_add_{suffix}")
