"""Kernel backend selection.

On CUDA the workers run the Triton kernels; on a CPU they run the torch twins in
``reference.py`` (attention through its planned form, ``cpu_attention.py``).
``ACTORLM_ATTENTION_BACKEND=triton|torch`` overrides the choice (Triton on a CPU works only under
``TRITON_INTERPRET=1``, which is how the kernels are tested here).

A backend is what a model layer and the runner need: ``plan(q_lens, seq_lens, block_ids,
block_size, device, tables=...)`` is called once per step by the runner (from Python lists,
and the metadata's block table and seq_lens tensors) and its result rides in
``AttentionMetadata.plan``; ``attention(q, k, v, k_cache, v_cache, meta, scale)`` writes
a layer's new K/V into the paged cache and attends; ``sample`` is the sampling kernel.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch


class KernelBackend(NamedTuple):
    name: str
    plan: Callable
    attention: Callable
    sample: Callable
    # (qkv, cos, sin_signed, k_cache, v_cache, meta, scale, num_heads, num_kv_heads) -> the
    # attention output, with RoPE and the K/V write done on the fused projection in one pass;
    # None (or returning None) where the layer rotates q and k itself and calls ``attention``
    rope_attention: Callable | None = None


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
        from actorlm.kernels.triton.sampling import sample

        return KernelBackend("triton", _no_plan, _triton_attention, sample)
    from actorlm.kernels.cpu.attention import (plan_attention, rope_write_and_attend,
                                               write_and_attend)
    from actorlm.kernels.cpu.sampler import sample as sample_ref

    return KernelBackend("torch", plan_attention, write_and_attend, sample_ref,
                         rope_write_and_attend)


def _no_plan(*args, **kwargs) -> None:
    return None


def _triton_attention(q, k, v, k_cache, v_cache, meta, scale):
    from actorlm.kernels.triton.paged_attention import paged_attention, write_kv

    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                           meta.seq_lens, scale, max_query_len=meta.max_query_len,
                           max_seq_len=meta.max_seq_len)
