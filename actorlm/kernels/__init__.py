"""The kernels, behind one door: ``KernelBackend`` (``backend.py``), chosen per device here.

On CUDA the workers run the Triton wing (``kernels/triton/``); on a CPU the C++ wing
(``kernels/cpu/``: kernels compiled on first use, each with a torch path where they are not
built). ``ACTORLM_ATTENTION_BACKEND=triton|cpu`` overrides the choice (Triton on a CPU works
only under ``TRITON_INTERPRET=1``, which is how its kernels are tested here). Models and the
runner import this package only, never a wing; ``reference.py`` is the oracle tests hold both
wings to.
"""

from __future__ import annotations

import logging
import os

import torch

from actorlm.kernels.backend import (ACTIVATIONS, QUANTIZED_FORMATS, ActivationQuant,
                                     AttentionLayer, DecoderLayerPlan, Experts, KernelBackend,
                                     MoePlan, Norm, QuantizedWeight)
from actorlm.kernels.metadata import AttentionMetadata

__all__ = ["ACTIVATIONS", "QUANTIZED_FORMATS", "ActivationQuant", "AttentionLayer", "AttentionMetadata", "DecoderLayerPlan",
           "Experts", "KernelBackend", "MoePlan", "Norm", "QuantizedWeight", "select_backend"]

log = logging.getLogger(__name__)

BACKENDS = ("cpu", "triton")
_DEPRECATED = {"torch": "cpu"}  # the CPU backend's former name


def select_backend(device: torch.device | str) -> KernelBackend:
    """The kernels for ``device``, honouring ``ACTORLM_ATTENTION_BACKEND``."""
    device = torch.device(device)
    choice = os.environ.get("ACTORLM_ATTENTION_BACKEND", "").strip().lower()
    if choice in _DEPRECATED:
        log.warning("ACTORLM_ATTENTION_BACKEND=%s is deprecated: use %s", choice,
                    _DEPRECATED[choice])
        choice = _DEPRECATED[choice]
    if choice not in ("", *BACKENDS):
        raise ValueError(f"ACTORLM_ATTENTION_BACKEND must be one of {', '.join(BACKENDS)}, "
                         f"got {choice!r}")
    if not choice:
        choice = "triton" if device.type == "cuda" else "cpu"
    if choice == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the Triton backend on a CPU needs TRITON_INTERPRET=1")
        from actorlm.kernels.triton.backend import TritonBackend

        return TritonBackend(device)
    from actorlm.kernels.cpu.backend import CpuBackend

    return CpuBackend(device)
