"""Linear and embedding layers whose weights come from a checkpoint, plain or tensor-parallel.

A column-parallel layer is a plain ``Linear`` over this rank's rows of the weight; the two
layers here are the ones whose forward changes when split (see ``actorlm.models.parallel``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actorlm.kernels.cpu.linear import packed_linear
from actorlm.models.parallel import TensorParallel, all_reduce


class Linear(nn.Module):
    """nn.Linear without the random init: every weight comes from the checkpoint."""

    def __init__(self, in_features, out_features, bias, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False) if bias else None
        self.packed = None  # x -> linear(x), over a weight laid out for the device's GEMM

    def pack(self) -> None:
        """Once the weights are loaded: run on a packed copy where the device gains by it."""
        self.packed = packed_linear(self.weight, self.bias)

    def drop_plain_weight(self) -> None:
        """Where a packed copy runs the layer, let the plain weight go: the model then holds
        each weight once (a packing that still needs it keeps its own reference)."""
        if self.packed is not None:
            self.weight = None

    def forward(self, x):
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """This rank's ``in_features / size`` input columns: partial outputs summed over the ranks,
    then the bias added once (on the sum, identically on every rank)."""

    def __init__(self, in_features, out_features, bias, tp: TensorParallel, dtype, device):
        super().__init__(in_features // tp.size, out_features, bias, dtype, device)
        self.tp = tp

    def pack(self) -> None:
        self.packed = packed_linear(self.weight, None)  # the bias comes after the reduce

    def forward(self, x):
        # x: [T, in / size] -> [T, out]
        y = self.packed(x) if self.packed is not None else F.linear(x, self.weight)
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
