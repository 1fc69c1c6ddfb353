"""Kernel backend selection.

On CUDA the workers run the Triton kernels; on a CPU they run the torch twins in
``reference.py``. ``ACTORLM_ATTENTION_BACKEND=triton|torch`` overrides the choice (Triton on
a CPU works only under ``TRITON_INTERPRET=1``, which is how the kernels are tested here).
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch


class KernelBackend(NamedTuple):
    name: str
    write_kv: Callable
    paged_attention: Callable
    sample: Callable


def select_backend(device: torch.device | str) -> KernelBackend:
    """The kernels for ``device``, honouring ``ACTORLM_ATTENTION_BACKEND``."""
    device = torch.device(device)
    choice = os.environ.get("ACTORLM_ATTENTION_BACKEND", "").strip().lower()
    if choice not in ("", "triton", "torch"):
        raise ValueError(f"ACTORLM_ATTENTION_BACKEND must be 'triton' or 'torch', got {choice!r}")
    if not choice:
        choice = "triton" if device.type == "cuda" else "torch"
    if choice == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the Triton backend on a CPU needs TRITON_INTERPRET=1")
        from actorlm.kernels.paged_attention import paged_attention, write_kv
        from actorlm.kernels.sampling import sample

        return KernelBackend("triton", write_kv, paged_attention, sample)
    from actorlm.kernels.reference import paged_attention_ref, sample_ref, write_kv_ref

    return KernelBackend("torch", write_kv_ref, paged_attention_ref, sample_ref)
