"""The layers whose weights come from a checkpoint: linear (plain or tensor-parallel), embedding
and RMS norm, each running on the kernel backend it is handed.

A column-parallel layer is a plain ``Linear`` over this rank's rows of the weight; the two
parallel layers here are the ones whose forward changes when split (see
``actorlm.models.parallel``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actorlm.kernels import KernelBackend, Norm
from actorlm.models.parallel import TensorParallel, all_reduce


class Linear(nn.Module):
    """nn.Linear without the random init: every weight comes from the checkpoint. Once loaded,
    ``prepare`` hands it to the backend, which lays it out for its GEMM; the layer then runs
    on that and lets its own reference to the weight go (the model holds each weight once)."""

    def __init__(self, in_features, out_features, bias, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False) if bias else None
        self.prepared = None  # x -> linear(x): the backend's, once the weights are loaded

    def prepare(self, backend: KernelBackend) -> None:
        self.prepared = backend.prepare_linear(self.weight, self.bias)
        self.weight = None  # a tied LM head's is the embedding's: it stays there

    def forward(self, x):
        if self.prepared is not None:
            return self.prepared(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """This rank's ``in_features / size`` input columns: partial outputs summed over the ranks,
    then the bias added once (on the sum, identically on every rank)."""

    def __init__(self, in_features, out_features, bias, tp: TensorParallel, dtype, device):
        super().__init__(in_features // tp.size, out_features, bias, dtype, device)
        self.tp = tp

    def prepare(self, backend: KernelBackend) -> None:
        self.prepared = backend.prepare_linear(self.weight, None)  # the bias: after the reduce
        self.weight = None

    def forward(self, x):
        # x: [T, in / size] -> [T, out]
        y = self.prepared(x) if self.prepared is not None else F.linear(x, self.weight)
        all_reduce(self.tp, y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """This rank's contiguous slice of the vocabulary, padded up to an equal share per rank:
    tokens outside the slice embed as zeros and the ranks' embeddings are summed. Its weight
    [V_pad / size, hidden] also serves as a tied LM head's."""

    def __init__(self, vocab_size, dim, tp: TensorParallel, dtype, device):
        super().__init__()
        self.tp = tp
        self.num_rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.num_rows
        # zeros: the padding rows past the vocabulary are never loaded
        self.weight = nn.Parameter(torch.zeros(self.num_rows, dim, dtype=dtype, device=device), False)

    def forward(self, input_ids):
        # input_ids: [T] -> [T, hidden]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_rows)  # [T]
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0)
        return all_reduce(self.tp, x)


class RMSNorm(nn.Module):
    """An RMS norm (``kernels.Norm`` says how it scales), fused with the residual add before it
    where the layer has one."""

    def __init__(self, dim, eps, unit_offset: bool, backend: KernelBackend, dtype, device):
        super().__init__()
        self.backend, self.eps, self.unit_offset = backend, eps, unit_offset
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), False)

    @property
    def norm(self) -> Norm:
        return Norm(self.weight, self.eps, self.unit_offset)

    def forward(self, x, residual=None):
        """``norm(x)``; with ``residual``: (norm(x + residual), x + residual), where x and
        residual may be written."""
        if residual is not None:
            return self.backend.add_rms_norm(x, residual, self.norm)
        return self.backend.rms_norm(x, self.norm)
