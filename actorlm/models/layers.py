"""The layers whose weights come from a checkpoint: linear (plain or tensor-parallel), embedding
and RMS norm, each running on the kernel backend it is handed. A linear layer's or the
embedding's weight may arrive in GGUF blocks (``QuantizedWeight``) and stay in them.

A column-parallel layer is a plain ``Linear`` over this rank's rows of the weight; the two
parallel layers here are the ones whose forward changes when split (see
``actorlm.models.parallel``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from actorlm.kernels import ActivationQuant, KernelBackend, Norm, QuantizedWeight, portable
from actorlm.models.fp8 import joined
from actorlm.models.parallel import TensorParallel, all_reduce

log = logging.getLogger(__name__)


class Linear(nn.Module):
    """nn.Linear without the random init: every weight comes from the checkpoint, as floats
    into ``weight`` or in blocks through ``load_quantized``. Once loaded, ``prepare`` hands it
    to the backend, which lays it out for its GEMM; the layer then runs on that and lets its
    own reference to the weight go (the model holds each weight once)."""

    def __init__(self, in_features, out_features, bias, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False) if bias else None
        self.quantized: dict[int, QuantizedWeight] = {}  # first row -> rows in blocks
        self.prepared = None  # x -> linear(x): the backend's, once the weights are loaded
        self.in_features, self.out_features = in_features, out_features
        self.lora = None  # its LoRA adapters' slot table (``lora_slots.LoRAWeights``), if any
        self.input_quant: ActivationQuant | None = None  # an FP8 checkpoint's, for its input

    def load_quantized(self, first_row: int, weight: QuantizedWeight) -> None:
        """Rows ``first_row:`` in blocks (a merged layer's parts arrive one by one, each in its
        own format)."""
        self.quantized[first_row] = weight

    def quantize_inputs(self, quant: ActivationQuant) -> None:
        """Round the input to FP8 as ``quant`` says before the matmul (a merged layer's parts
        each say it for their shared input)."""
        if quant.group is not None and self.in_features % quant.group:
            raise ValueError(f"{self.in_features} input features (a tensor-parallel rank's "
                             f"share, where split) are not whole FP8 activation groups of "
                             f"{quant.group}")
        self.input_quant = quant if self.input_quant is None else joined(self.input_quant, quant)

    bias_in_kernel = True  # the bias is added by the prepared GEMM

    def prepare(self, backend: KernelBackend) -> None:
        self.prepared = backend.prepare_linear(self._weight_to_prepare(),
                                               self.bias if self.bias_in_kernel else None)
        if self.input_quant is not None:
            self.prepared = backend.quantize_inputs(self.prepared, self.input_quant,
                                                    self._row_max())
        self.weight = None  # a tied LM head's is the embedding's: it stays there
        self.quantized = {}  # the prepared layer holds what it needs

    def _weight_to_prepare(self) -> torch.Tensor | QuantizedWeight | tuple[QuantizedWeight, ...]:
        """The weight whole: its parts in blocks, stacked; or, where some rows came as floats,
        all of it as floats (a merged layer's GEMM takes one kind)."""
        if not self.quantized:
            return self.weight
        parts = tuple(part for _, part in sorted(self.quantized.items()))
        if sum(part.shape[0] for part in parts) == self.weight.shape[0]:
            return parts[0] if len(parts) == 1 else parts
        log.info("a layer with rows both in blocks and in floats runs in %s",
                 str(self.weight.dtype).removeprefix("torch."))
        with torch.no_grad():
            for first, part in self.quantized.items():
                self.weight[first:first + part.shape[0]] = \
                    portable.dequantize(part, self.weight.dtype).to(self.weight.device)
        self.quantized = {}
        return self.weight

    def _row_max(self):
        """How a per-token magnitude over this layer's input features is joined: it has all of
        them."""
        return None

    def forward(self, x):
        y = self.prepared(x) if self.prepared is not None else F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.add(y, x)


class RowParallelLinear(Linear):
    """This rank's ``in_features / size`` input columns: partial outputs summed over the ranks,
    then the bias added once (on the sum, identically on every rank)."""

    bias_in_kernel = False  # added once, after the reduce

    def __init__(self, in_features, out_features, bias, tp: TensorParallel, dtype, device):
        super().__init__(in_features // tp.size, out_features, bias, dtype, device)
        self.tp = tp

    def _row_max(self):
        """Each rank holds a share of the row: the largest magnitude over all of them."""
        return (lambda largest: all_reduce(self.tp, largest, "max")) \
            if self.tp.is_parallel else None

    def forward(self, x):
        # x: [T, in / size] -> [T, out]
        y = self.prepared(x) if self.prepared is not None else F.linear(x, self.weight)
        if self.lora is not None:  # this rank's columns of A: a partial delta, reduced with y
            y = self.lora.add(y, x)
        all_reduce(self.tp, y)
        return y if self.bias is None else y + self.bias


class Embedding(nn.Module):
    """The token embeddings: rows of ``weight``, or of its blocks (``load_quantized``) looked
    up through the backend. Its weight also serves as a tied LM head's."""

    def __init__(self, vocab_size, dim, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim, dtype=dtype, device=device), False)
        self.quantized: QuantizedWeight | None = None
        self.lookup = None  # ids -> rows: the backend's, for a weight in blocks

    def load_quantized(self, first_row: int, weight: QuantizedWeight) -> None:
        self.quantized = weight

    def prepare(self, backend: KernelBackend) -> None:
        if self.quantized is not None:
            self.lookup = backend.prepare_embedding(self.quantized, self.weight.dtype)
            self.weight = None

    def prepare_tied(self, backend: KernelBackend, head: Linear) -> None:
        """Blocks that a tied LM head ``head`` shares: one copy serves both, laid out as the
        backend runs the head."""
        self.lookup, head.prepared = backend.prepare_tied_embedding(self.quantized,
                                                                    self.weight.dtype)
        self.weight = self.quantized = head.weight = None

    def forward(self, input_ids):
        # input_ids: [T] -> [T, hidden]
        if self.lookup is not None:
            return self.lookup(input_ids)
        return F.embedding(input_ids, self.weight)


class VocabParallelEmbedding(Embedding):
    """This rank's contiguous slice of the vocabulary, padded up to an equal share per rank:
    tokens outside the slice embed as zeros and the ranks' embeddings are summed. Its weight
    [V_pad / size, hidden] also serves as a tied LM head's."""

    def __init__(self, vocab_size, dim, tp: TensorParallel, dtype, device):
        self.num_rows = -(-vocab_size // tp.size)
        super().__init__(self.num_rows, dim, dtype, device)
        self.weight.data.zero_()  # the padding rows past the vocabulary are never loaded
        self.tp = tp
        self.start = tp.rank * self.num_rows

    def forward(self, input_ids):
        # input_ids: [T] -> [T, hidden]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_rows)  # [T]
        x = super().forward(local.masked_fill(outside, 0))
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


class LayerNorm(nn.Module):
    """A layer norm (the mean taken out, then the variance; by ``weight``, plus ``bias`` where
    the family has one), fused with the residual add before it as ``RMSNorm`` is. It runs on
    torch's kernel, which computes in fp32 and rounds once, as transformers' does; its
    ``norm`` describes it to the backend's one-call decode step."""

    def __init__(self, dim, eps, bias: bool, dtype, device, learned: bool = True):
        super().__init__()
        self.eps = eps
        if learned:
            self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), False)
        else:  # (OLMo's: no weight to load; ones, so that every path scales by one)
            self.register_buffer("weight", torch.ones(dim, dtype=dtype, device=device), False)
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), False) \
            if bias else None

    @property
    def norm(self) -> Norm:
        return Norm(self.weight, self.eps, False, self.bias, layer=True)

    def forward(self, x, residual=None):
        """``norm(x)``; with ``residual``: (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            return self(x), x
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class HeadLayerNorm(LayerNorm):
    """A LayerNorm of each head's features by that head's own weight (and bias), stored flat,
    [heads x head_dim] as the projection's rows: Cohere's and StableLM 2 12B's q/k norms, and
    Phi's one per model repeated over the heads as the weights load. One normalisation over
    the heads at once, in fp32 with the weight applied before rounding (Cohere's order; torch's
    LayerNorm, which the others use, rounds once too)."""

    def __init__(self, num_heads, head_dim, eps, bias: bool, dtype, device):
        super().__init__(num_heads * head_dim, eps, bias, dtype, device)
        self.head_dim = head_dim

    def forward(self, x, residual=None):
        # x: [T, heads x head_dim] (rows may be strided) -> the same, normed head by head
        assert residual is None
        h = x.float().view(x.shape[0], -1, self.head_dim)
        normed = torch.nn.functional.layer_norm(h, (self.head_dim,), eps=self.eps)
        normed = normed * self.weight.float().view(-1, self.head_dim)
        if self.bias is not None:
            normed = normed + self.bias.float().view(-1, self.head_dim)
        return normed.view(x.shape).to(x.dtype)


class SplitRMSNorm(RMSNorm):
    """An RMS norm over features that tensor parallelism splits over the ranks (OLMoE's q and k
    norms span every head): each rank norms its share by the mean square of all of them, its
    sum of squares summed over the ranks. Where several ranks hold the same features (one KV
    head replicated) they count once per rank in the sum and in the count alike, so the mean
    is the whole projection's."""

    def __init__(self, dim, eps, backend: KernelBackend, dtype, device, tp: TensorParallel):
        super().__init__(dim, eps, False, backend, dtype, device)
        self.tp = tp

    def forward(self, x, residual=None):
        # x: [T, dim] (rows may be strided) -> [T, dim]
        assert residual is None
        if not self.tp.is_parallel:
            return super().forward(x)
        h = x.float()  # HF's order: the mean square in fp32, rounded before the weight
        sum_sq = all_reduce(self.tp, h.pow(2).sum(-1, keepdim=True))  # [T, 1]
        normed = h * torch.rsqrt(sum_sq / (x.shape[-1] * self.tp.size) + self.eps)
        return self.weight * normed.to(x.dtype)
