"""A decoder layer's mixture of experts, in place of its dense MLP (Qwen3-MoE, Mixtral,
Qwen2-MoE, OLMoE, GLM-4.5, ERNIE 4.5, Hunyuan; ``moe_families.py`` says which layers and how
they route).

A router (a linear layer, [E, H]) scores every expert for each token; the backend's
``fused_moe`` sends each token to its ``top_k`` experts and sums their outputs, weighted by the
router's softmax. GLM-4.5 routes by DeepSeek's sigmoid scores instead, ERNIE 4.5 by the
softmax's plus a bias, handed to the same door as logits whose softmax gives their weights
(``scored_routing``). Qwen2-MoE adds a shared expert, a dense MLP every token takes, scaled by
``sigmoid(shared_expert_gate(x))``; Granite MoE's shared variant, GLM-4.5, ERNIE 4.5 and
Hunyuan add one unscaled.

The experts' weights are held stacked, one tensor per projection — gate/up [E, 2I, H] (each
expert's rows [gate | up]) and down [E, H, I] — as transformers holds them in memory; a
checkpoint's per-expert tensors (``experts.{e}.gate_proj.weight`` …) are copied into their
rows as they load (``expert_weights.py``). Experts that arrive in GGUF blocks (a GGUF file's,
or ``--quantization``'s) stay in them, one ``QuantizedWeight`` per expert and projection (its
gate and up rows parts of one layer, as a dense MLP's are), and the backend prepares each
expert's layers on its quantized kernels. Tensor-parallel: each rank holds its share of every
expert's intermediate features (and of the shared expert's), so the block's output is a
partial sum on each rank, joined by one all-reduce, as a dense MLP's is. Expert-parallel
(``expert_parallel.py``): each rank holds its share of the experts, whole, which the backend
runs as experts ``first_expert`` on; the slots routed elsewhere add nothing, and the same
all-reduce sums the ranks' experts.

A model's ``MoeTimer`` (shared by its blocks) sums each forward's seconds in the routers and in
the experts, for the step's trace record (``StepSummary.router_s`` / ``experts_s``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from actorlm.kernels import Experts, KernelBackend, QuantizedWeight, portable
from actorlm.kernels.resident import resident
from actorlm.models.layers import Linear
from actorlm.models.parallel import TensorParallel, all_reduce

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoeSpec:
    """A layer's routed experts, as its config says (whole sizes, before a split)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights divided by their sum (Mixtral; norm_topk_prob)
    shared_intermediate_size: int | None = None  # a shared expert's (Qwen2-MoE's, Granite's)
    shared_gated: bool = True  # scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE) or not
    # routing by scores (``scored_routing``): "sigmoid", DeepSeek's (GLM-4.5's), or "softmax";
    # the experts of highest score plus a learned bias (``score_bias``: DeepSeek's, ERNIE's),
    # within the ``top_groups`` best of ``num_groups`` groups, weighted by their scores
    # (renormalised by ``renormalize``, by a sum of at least ``norm_min``) times ``scale``
    scoring: str = "softmax"
    score_bias: bool = False
    num_groups: int = 1
    top_groups: int = 1
    scale: float = 1.0
    norm_min: float = 0.0
    fp32_router: bool = False  # the router's logits in fp32 whatever the model's dtype (Hunyuan)
    biased: bool = False  # the router and each expert's projections have biases (GPT-OSS)

    @property
    def routed_by_scores(self) -> bool:
        """Whether the block routes (``scored_routing``) rather than the kernels' softmax."""
        return self.scoring == "sigmoid" or self.score_bias

    @property
    def router_in_fp32(self) -> bool:
        """Whether the router scores in fp32 (its families keep it so where they route by
        scores, and Hunyuan's)."""
        return self.fp32_router or self.routed_by_scores


class MoeTimer:
    """Seconds of one forward in its mixture-of-experts layers, summed over them: ``router_s``
    in the routers (the router's linear; on the one-call decode step also its top-k, which the
    Python layers' ``fused_moe`` does with the experts), ``experts_s`` in the routed experts
    and, where the layer has one, the shared expert.

    A model keeps one only on a CPU: on a GPU a clock without a synchronize sees kernel
    launches, not kernels, and a synchronize per layer would stall the stream it measures."""

    __slots__ = ("router_s", "experts_s")

    def __init__(self):
        self.router_s = self.experts_s = 0.0

    def reset(self) -> None:
        self.router_s = self.experts_s = 0.0

    def add(self, router_s: float, experts_s: float) -> None:
        self.router_s += router_s
        self.experts_s += experts_s


class RoutedExperts(nn.Module):
    """The projections of this rank's experts (``num_experts`` of them from ``first_expert``:
    all, or its share under expert parallelism), stacked: ``intermediate_size`` features of
    each (this rank's share, or all under expert parallelism)."""

    def __init__(self, spec: MoeSpec, hidden_size: int, activation: str, dtype, device,
                 tp: TensorParallel):
        super().__init__()
        self.first_expert, self.num_experts = tp.local_experts(spec.num_experts)
        self.intermediate_size = size = tp.expert_features(spec.intermediate_size)
        self.activation = activation
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * size, hidden_size,
                                                     dtype=dtype, device=device), False)
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, hidden_size, size,
                                                  dtype=dtype, device=device), False)
        self.gate_up_bias = self.down_bias = None
        if spec.biased:  # (every rank loads down's; one adds it: ``_biases``)
            self.gate_up_bias = nn.Parameter(torch.empty(self.num_experts, 2 * size,
                                                         dtype=dtype, device=device), False)
            self.down_bias = nn.Parameter(torch.empty(self.num_experts, hidden_size,
                                                      dtype=dtype, device=device), False)
        self.adds_down_bias = tp.expert_parallel or tp.rank == 0
        self.dtype = dtype
        # this rank's expert e's rows in blocks: (e, first row of gate_up) -> rows; e -> down
        self.quantized_gate_up: dict[tuple[int, int], QuantizedWeight] = {}
        self.quantized_down: dict[int, QuantizedWeight] = {}
        self.prepared = None  # the backend's layout of the experts, once they are loaded

    def load_quantized(self, projection: str, expert: int, first_row: int,
                       weight: QuantizedWeight) -> None:
        """Rows ``first_row:`` of this rank's expert ``expert``'s ``projection``
        (``gate_up_proj``: gate rows from 0, up rows from I; ``down_proj``: all) in blocks.
        The loaders hand experts' blocks over uncopied (a view of the file, or fresh from the
        quantizer): copied here, a rank copies only its own share of them."""
        weight = QuantizedWeight(weight.type_name, resident(weight.blocks), weight.shape)
        if projection == "down_proj":
            self.quantized_down[expert] = weight
        else:
            self.quantized_gate_up[expert, first_row] = weight

    def prepare(self, backend: KernelBackend) -> None:
        """Once loaded: the experts laid out by the backend; where it made its own copy, the
        stacked weights go (the model holds each weight once)."""
        plain = self._experts_to_prepare()
        self.prepared = backend.prepare_experts(plain)
        if self.prepared is not plain:
            self.gate_up_proj = self.down_proj = None
        self.quantized_gate_up, self.quantized_down = {}, {}  # the prepared experts hold them

    def _experts_to_prepare(self) -> Experts:
        """Every expert in blocks, or, where some rows came as floats, all of them as floats
        (the stacked tensors; the blocks dequantized into them), as a ``Linear`` does."""
        plain = Experts(self.gate_up_proj, self.down_proj, self.activation, self.first_expert,
                        *self._biases())
        if not self.quantized_gate_up and not self.quantized_down:
            return plain
        gate_up = [tuple(part for (e, _), part in sorted(self.quantized_gate_up.items())
                         if e == expert) for expert in range(self.num_experts)]
        if len(self.quantized_down) == self.num_experts and all(
                sum(part.shape[0] for part in parts) == 2 * self.intermediate_size
                for parts in gate_up):
            return Experts(tuple(gate_up), tuple(self.quantized_down[e]
                                                 for e in range(self.num_experts)),
                           self.activation, self.first_expert, *self._biases())
        log.info("routed experts with rows both in blocks and in floats run in %s",
                 str(self.dtype).removeprefix("torch."))
        with torch.no_grad():
            for (expert, first), part in self.quantized_gate_up.items():
                self.gate_up_proj[expert, first:first + part.shape[0]] = \
                    portable.dequantize(part, self.dtype).to(self.gate_up_proj.device)
            for expert, part in self.quantized_down.items():
                self.down_proj[expert] = \
                    portable.dequantize(part, self.dtype).to(self.down_proj.device)
        return plain

    @property
    def stacked(self):
        """What the backend's ``fused_moe`` takes: the prepared experts, or the stacked ones."""
        if self.prepared is not None:
            return self.prepared
        return Experts(self.gate_up_proj, self.down_proj, self.activation, self.first_expert,
                       *self._biases())

    def _biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(gate_up's, down's) biases, as ``Experts`` takes them: split over tensor-parallel
        ranks, down's is added by one of them (the sum over the ranks adds it once)."""
        return self.gate_up_bias, self.down_bias if self.adds_down_bias else None


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE, Granite) a shared expert, gated where the spec
    says: ``shared_expert`` is a dense MLP that does not all-reduce its output, since the
    block reduces once for both."""

    def __init__(self, spec: MoeSpec, hidden_size: int, activation: str,
                 backend: KernelBackend, dtype, device, tp: TensorParallel,
                 shared_expert: nn.Module | None = None):
        super().__init__()
        self.backend, self.tp, self.spec = backend, tp, spec
        self.routed_here = spec.routed_by_scores
        self.gate = Linear(hidden_size, spec.num_experts, spec.biased,  # every rank: all experts
                           torch.float32 if spec.router_in_fp32 else dtype, device)
        self.score_bias = nn.Parameter(torch.zeros(spec.num_experts, device=device), False) \
            if spec.score_bias else None
        self.experts = RoutedExperts(spec, hidden_size, activation, dtype, device, tp)
        self.shared_expert = shared_expert
        self.shared_expert_gate = None if shared_expert is None or not spec.shared_gated else \
            Linear(hidden_size, 1, False, dtype, device)
        self.timer: MoeTimer | None = None  # the model's, where it times its forwards

    def forward(self, x):
        # x: [T, H] -> router logits [T, E] (every expert's) -> [T, H] (a partial sum on
        # each rank)
        timer = self.timer
        t_start = time.perf_counter() if timer is not None else 0.0
        router_logits, factor = self.gate(x.float() if self.spec.router_in_fp32 else x), None
        if self.routed_here:
            router_logits, factor = scored_routing(router_logits, self.score_bias, self.spec)
        t_routed = time.perf_counter() if timer is not None else 0.0
        out = self.backend.fused_moe(x, router_logits, self.experts.stacked, self.spec.top_k,
                                     self.spec.renormalize or factor is not None)
        if factor is not None:
            out = (out * factor).to(x.dtype)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                # the gate [T, 1] is the same on every rank, so it may scale the partial sums
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if timer is not None:  # (the all-reduce is neither router nor experts)
            timer.add(t_routed - t_start, time.perf_counter() - t_routed)
        return all_reduce(self.tp, out)


def scored_routing(logits: torch.Tensor, bias: torch.Tensor | None, spec: MoeSpec
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing by scores (DeepSeek's, ERNIE's), as logits that the backend's softmax routing
    (renormalised) turns into its weights, and each token's factor [T, 1] after: the chosen
    experts' logits are their weights' logs and the others' -inf, so the softmax over them is
    each weight over their sum; the factor brings the sum back where the family does not
    renormalise (or divides by ``norm_min`` where the sum is smaller), and the scale. The
    experts are the top k of the scores (sigmoid or softmax of the logits) + bias, among the
    ``top_groups`` groups whose two best experts score most (transformers'
    ``Glm4MoeTopkRouter``, ``Ernie4_5_MoeTopKRouter``)."""
    scores = logits.sigmoid() if spec.scoring == "sigmoid" else logits.softmax(-1)  # fp32
    choice = scores if bias is None else scores + bias
    if spec.num_groups > 1:
        per_group = spec.num_experts // spec.num_groups
        group_scores = choice.view(-1, spec.num_groups, per_group).topk(2, -1).values.sum(-1)
        best = group_scores.topk(spec.top_groups, -1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~kept.repeat_interleave(per_group, 1), float("-inf"))
    chosen = choice.topk(spec.top_k, -1).indices
    weights = scores.gather(1, chosen)
    routed = torch.full_like(scores, float("-inf")).scatter_(1, chosen, weights.log())
    total = weights.sum(-1, keepdim=True)
    factor = total / total.clamp(min=spec.norm_min) if spec.renormalize else total
    return routed, factor * spec.scale
