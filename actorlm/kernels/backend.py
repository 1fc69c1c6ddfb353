"""The door: what a model layer and the runner may ask of the kernels, whatever the device.

A model never imports a device wing (``kernels/cpu/``, ``kernels/triton/``): it is handed a
``KernelBackend`` and calls its methods, with the small types below as their vocabulary. Each
wing implements every method; ``reference.py`` states what each must compute.

The types describe, they do not compute: a ``Norm`` is a weight and how it scales; an
``AttentionLayer`` a layer's heads and options; ``Experts`` a layer's routed experts, stacked;
a ``DecoderLayerPlan`` one decoder layer as a whole, which a model family gives so that a
backend may run a decode step through every layer at once (``decode_step``) without knowing
the family.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from actorlm.kernels import lora, rejection
from actorlm.kernels.lora import LoRATable
from actorlm.kernels.metadata import AttentionMetadata

# act_and_mul's (and an ungated MLP's): SiLU, GeLU's tanh approximation, ReLU (OPT's)
# (relu2: relu(x) squared; gelu: the exact one, by erf; swiglu_oai, gated only: GPT-OSS's
# clamped SwiGLU, ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)`` of g = min(gate, 7))
ACTIVATIONS = ("silu", "gelu_tanh", "relu", "relu2", "gelu", "swiglu_oai")
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


class Norm(NamedTuple):
    """An RMS norm over the last dimension: ``x * rsqrt(mean(x^2) + eps)`` in fp32, then
    scaled. ``unit_offset`` False (Llama, Qwen, Mistral): by ``weight``, after the normed value
    is rounded to x's dtype; True (Gemma): by ``1 + weight``, in fp32, rounded once. ``layer``:
    a LayerNorm instead (StarCoder2, Phi-2, Cohere: the mean taken out, by weight, plus
    ``bias`` where there is one, rounded once); only the one-call decode step takes one (the
    layers compute theirs in torch)."""

    weight: torch.Tensor  # [H]
    eps: float
    unit_offset: bool = False
    bias: torch.Tensor | None = None  # [H]
    layer: bool = False


class AttentionLayer(NamedTuple):
    """One layer's attention as the kernels see it (this rank's heads)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int | None = None  # sliding window (positions a query sees); None: all before it
    q_norm: Norm | None = None  # per-head norms of q and k, before RoPE (Qwen3, Gemma 3)
    k_norm: Norm | None = None
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    # [Hq] fp32, a logit per head that joins its softmax's denominator and no value: each
    # head's probabilities sum to less than one (GPT-OSS's attention sinks)
    sinks: torch.Tensor | None = None


# the GGUF block formats both wings have kernels for (others are dequantized at load)
QUANTIZED_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


class QuantizedWeight(NamedTuple):
    """A weight kept in a GGUF block format (``Q4_0``, ``Q8_0``, ``Q4_K``…): ``blocks`` its raw
    bytes, one row of blocks per output feature, as the file stores them; ``shape`` the
    (out_features, in_features) they encode."""

    type_name: str
    blocks: torch.Tensor  # uint8
    shape: tuple[int, int]


class ActivationQuant(NamedTuple):
    """A linear layer's input rounded to FP8 (e4m3) before its matmul, as an FP8 checkpoint's
    math asks: scaled by a static ``scale`` (one per tensor), else by each row's largest
    magnitude over 448, per ``group`` of consecutive features or over the whole row (``group``
    None); the rounded values times their scale, back in the input's dtype, then multiply
    the weight."""

    group: int | None = None
    scale: float | None = None


class Experts(NamedTuple):
    """A layer's routed experts, each a gated MLP (this rank's share of every expert's
    intermediate features, or under expert parallelism its share of the experts, whole):
    expert ``first_expert + e`` computes ``down[e] @ act_and_mul(gate_up[e] @ x)`` (plus
    ``gate_up_bias[e]`` before the activation and ``down_bias[e]`` after, where given: GPT-OSS's
    experts; under tensor parallelism one rank holds ``down_bias``, the others None). A token
    routed to an expert outside ``first_expert .. first_expert + E - 1`` (another rank's) gets
    nothing from it here.

    Floats come stacked, one tensor per projection. Weights kept in GGUF blocks come one entry
    per expert (``is_quantized``): its gate/up the ``QuantizedWeight`` parts of its rows, gate
    then up (each part in its own format, as a file may store them), and its down one
    ``QuantizedWeight``; a backend runs each expert's rows through its quantized linear
    kernel, so a step reads the blocks of the experts it routes to and no others."""

    gate_up: torch.Tensor | tuple[tuple[QuantizedWeight, ...], ...]  # [E, 2I, H]: [gate | up]
    down: torch.Tensor | tuple[QuantizedWeight, ...]  # [E, H, I]
    activation: str = "silu"  # one of ACTIVATIONS
    first_expert: int = 0  # the router's id of gate_up[0]
    gate_up_bias: torch.Tensor | None = None  # [E, 2I]: [gate | up], as gate_up's rows
    down_bias: torch.Tensor | None = None  # [E, H]

    @property
    def is_quantized(self) -> bool:
        return not isinstance(self.gate_up, torch.Tensor)


class MoePlan(NamedTuple):
    """A layer's mixture of experts in place of its dense MLP, as ``decode_step`` runs it:

        out = experts(top_k(softmax(router(h))))      (``KernelBackend.fused_moe``)
        out += sigmoid(shared_gate(h)) * down(act_and_mul(gate_up(h)))   (a shared expert)

    ``router`` and the shared expert's linear layers are what ``prepare_linear`` returned,
    ``experts`` what ``prepare_experts`` returned; no shared expert: the three are None; one
    without a gate (Granite's): ``shared_gate`` None, the sum unscaled."""

    router: Callable
    experts: object
    top_k: int
    renormalize: bool
    shared_gate_up: Callable | None = None
    shared_down: Callable | None = None
    shared_gate: Callable | None = None


class DecoderLayerPlan(NamedTuple):
    """A pre-norm decoder layer, as ``decode_step`` runs it:

        h = attn_norm(stream)                 (the stream: the residual, in the model dtype;
                                               without norms before the branches, OLMo 2's,
                                               attn_norm and mlp_norm are None: h = stream)
        a = o(attention(rope(qkv(h))))        (q/k norms before RoPE, if the layer has them:
                                               per head, or ``projection_norms`` over all
                                               heads of q and of k; then ``clip_qkv``)
        stream += attn_out_norm(a) or a       (times ``residual_scale``, if any)
        m = down(act_and_mul(gate_up(mlp_norm(stream))))
                                              (ungated, ``gated`` False: down(act(gate_up(.))))
        out = mlp_out_norm(m) or m            (the next layer adds it to the stream; times
                                               ``residual_scale``, if any)

    A ``parallel`` layer sums the branches, out = a + m, m of h as a is (Phi-2, Cohere: no
    mlp_norm) or of mlp_norm(stream), the same stream (GPT-NeoX). Norms are RMS norms or
    LayerNorms (``Norm.layer``).

    With ``moe`` (a ``MoePlan``) the experts take the dense MLP's place, and ``gate_up`` and
    ``down`` are None. The linear layers are what ``KernelBackend.prepare_linear`` returned; ``rope`` picks which
    of the step's RoPE tables the layer rotates by (families with one table: 0), ``kv_group``
    which of the step's attention metadata it reads its KV blocks through (``kv_groups``)."""

    attn_norm: Norm | None
    attention: AttentionLayer
    qkv: Callable
    o: Callable
    mlp_norm: Norm | None
    gate_up: Callable | None
    down: Callable | None
    activation: str = "silu"
    attn_out_norm: Norm | None = None
    mlp_out_norm: Norm | None = None
    rope: int = 0
    kv_group: int = 0
    moe: MoePlan | None = None
    # (q norm [Hq D], k norm [Hkv D]) over the whole projections, each row's q and k normed as
    # one vector before RoPE (OLMoE), in place of the attention's per-head norms
    projection_norms: tuple[Norm, Norm] | None = None
    clip_qkv: float | None = None  # q, k and v clamped to +-clip_qkv after the norms (OLMoE)
    residual_scale: float | None = None  # the attention's and MLP's outputs scaled (Granite)
    # LoRA adapters' slots of (qkv, o, gate_up, down), each a ``LoRATable`` or None: a step's
    # rows with a slot get its delta on each (``add_lora``); None: no LoRA
    lora: tuple[LoRATable | None, ...] | None = None
    # attention and MLP both read the stream, and the layer's output is their sum: the MLP
    # through attn_norm's output (Phi-2, Cohere; mlp_norm None) or its own (GPT-NeoX)
    parallel: bool = False
    gated: bool = True  # False: gate_up is one projection, act(it) alone (StarCoder2, Phi-2)


class KernelBackend:
    """The kernels of one device. Tensors are flattened batches of T tokens ([T, ...]); a
    method may write into the tensors its docstring says it may."""

    name: str

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    # --- norms and activations ----------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        """``norm`` of each row of x [T, H] (a new tensor)."""
        raise NotImplementedError

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the sum rounded to the dtype: x and residual
        [T, H]; both may be written."""
        raise NotImplementedError

    def act_and_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """gate_up [T, 2I], each row [gate | up] -> act(gate) * up [T, I], act(gate) rounded to
        the dtype first (HF's two ops); ``activation`` one of ``ACTIVATIONS``."""
        raise NotImplementedError

    # --- linear layers ------------------------------------------------------------------------

    def prepare_linear(self, weight: torch.Tensor | QuantizedWeight | Sequence[QuantizedWeight],
                       bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """Once, at load: ``x [..., in] -> x @ weight.T + bias`` over the weight laid out as
        this device runs it fastest (a sequence of weights in blocks: their rows stacked, a
        merged layer whose parts came in different formats). The result keeps what it needs;
        the caller may let its own reference to the weight go."""
        raise NotImplementedError

    def quantize_inputs(self, linear: Callable, quant: ActivationQuant,
                        row_max: Callable | None = None) -> Callable:
        """Once, at load: a prepared ``linear`` whose inputs are rounded to FP8 first
        (``ActivationQuant``); ``row_max`` joins a row's largest magnitude [T, 1] over the ranks
        that share the row (tensor parallelism), or is None."""
        from actorlm.kernels.portable import QuantizedInputs

        return QuantizedInputs(quant, linear, row_max)

    def prepare_embedding(self, weight: QuantizedWeight,
                          dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """Once, at load: ``ids [T] -> rows [T, dim]`` of an embedding kept in blocks, in
        ``dtype``."""
        raise no_quantized_kernels(weight, self.name)

    def prepare_tied_embedding(self, weight: QuantizedWeight, dtype: torch.dtype
                               ) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                          Callable[[torch.Tensor], torch.Tensor]]:
        """Once, at load: (the embedding's lookup, the tied LM head's linear) over one weight
        in blocks, held once however the LM head lays it out."""
        return self.prepare_embedding(weight, dtype), self.prepare_linear(weight, None)

    # --- attention ----------------------------------------------------------------------------

    def attention_metadata(self, q_lens: Sequence[int], seq_lens: Sequence[int],
                           block_ids: Sequence[Sequence[int]],
                           block_size: int) -> AttentionMetadata:
        """Once per step, from its Python lists: request b computes the last ``q_lens[b]``
        positions of its ``seq_lens[b]``-token context, stored in the blocks ``block_ids[b]``.
        The metadata carries this backend's plan of the step (``AttentionMetadata.plan``)."""
        return AttentionMetadata.build(q_lens, seq_lens, block_ids, block_size, self.device,
                                       self._plan)

    def _plan(self, q_lens, seq_lens, block_ids, block_size, tables):
        return None

    def attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                  kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                  layer: AttentionLayer) -> torch.Tensor:
        """One layer's attention from its fused projection qkv [T, (Hq + 2 Hkv) * D]: q and k
        normed per head (if the layer says so) and rotated (cos, sin_signed: [T, 1, D], sin's
        first half negated), the new K and V written into the paged caches
        ([num_blocks, block_size, Hkv, D]) at ``meta.slot_mapping``, then causal attention
        over each request's context (each head's softmax with its ``layer.sinks`` logit in the
        denominator, where the layer has them) -> [T, Hq * D]. qkv may be written."""
        raise NotImplementedError

    def bidirectional_attention(self, qkv: torch.Tensor, query_start_loc: Sequence[int],
                                layer: AttentionLayer,
                                score_bias: Callable[[int], torch.Tensor] | None = None
                                ) -> torch.Tensor:
        """An encoder's attention (BERT's): from the fused projection qkv [T, (Hq + 2 Hkv) *
        D], each request's rows (``query_start_loc``: request b owns rows ``[b]:[b + 1]``, its
        whole prompt) attend to all of its rows, before and after them, and nothing is read
        from or written to a KV cache -> [T, Hq * D]. No RoPE (the encoder turns q and k
        itself), no q/k norms; with ``layer.window``, a query sees the keys at most ``window``
        positions from it, either side (ModernBERT's local layers); ``score_bias(n)``, if
        given, is added to the scaled scores of a request of n rows ([Hq, n, n]: MPNet's
        relative positions). Here: torch's SDPA a request at a time,
        which runs on every device (``reference.bidirectional_attention_ref`` is what it
        computes)."""
        from actorlm.kernels.portable import bidirectional_attention

        return bidirectional_attention(qkv, query_start_loc, layer, score_bias)

    # --- routed experts -----------------------------------------------------------------------

    def prepare_experts(self, experts: Experts) -> object:
        """Once, at load: a layer's experts laid out as this device runs them fastest, for
        ``fused_moe`` (here: as they are). The result keeps what it needs; the caller may let
        its own references to the stacked weights go."""
        return experts

    def fused_moe(self, x: torch.Tensor, router_logits: torch.Tensor, experts,
                  top_k: int, renormalize: bool) -> torch.Tensor:
        """A mixture-of-experts MLP: each token of x [T, H] goes to the ``top_k`` experts of
        highest softmax(router_logits [T, E]) (in fp32), whose outputs are summed, weighted by
        those probabilities (divided by their sum with ``renormalize``) -> [T, H]
        (``reference.fused_moe_ref``). ``experts``: an ``Experts``, or what
        ``prepare_experts`` returned; routing is over all E of the router's experts, and only
        the slots on ``experts``' own (``Experts.first_expert`` on) contribute."""
        raise NotImplementedError

    # --- sampling -----------------------------------------------------------------------------

    def sample(self, logits, temperature, top_k, top_p, min_p, seeds,
               positions) -> torch.Tensor:
        """One token per row of logits [B, V] fp32 (``reference.sampling_probs_ref`` says from
        which distribution), with noise that is a pure function of (seed, position)."""
        raise NotImplementedError

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> [B] int64, each row's first maximum (a greedy step)."""
        return logits.argmax(dim=-1)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, table: LoRATable,
                 mapping: lora.LoRAMapping) -> torch.Tensor:
        """A linear layer's LoRA deltas on its output y [T, out] for its input x [T, in]: the
        rows of each slot s of ``mapping`` get ``x @ table.a[s].T @ table.b[s]``
        (``kernels.lora`` says how; torch, any device). Returns y, changed in place."""
        return lora.add_lora(y, x, table, mapping)

    def rejection_sample(self, logits, num_drafts, draft_token_ids, temperature, top_k, top_p,
                         min_p, seeds, positions) -> torch.Tensor:
        """Speculative decoding's verification: each request's accepted drafts and the token
        drawn after them, [B, max(k) + 1] padded with -1 (``kernels.rejection`` says how;
        its torch runs on any device)."""
        return rejection.rejection_sample(logits, num_drafts, draft_token_ids, temperature,
                                          top_k, top_p, min_p, seeds, positions)

    # --- a decode step through every layer ----------------------------------------------------

    def decode_step(self, layers: Sequence[DecoderLayerPlan],
                    dtype: torch.dtype) -> Callable | None:
        """Once, at load: ``step(x, ropes, kv_caches, metas, lora_slots=None) -> (out, stream)
        | None`` running a step in which every request decodes one token through all
        ``layers`` at once, as the layers would one by one (x [T, hidden] the embeddings;
        ``ropes`` the step's (cos, sin_signed) tables; ``kv_caches`` per layer; ``metas`` the
        step's attention metadata per KV-cache group, layer L reading ``metas[L.kv_group]``;
        ``lora_slots`` [T] int32 each row's LoRA slot in the layers' ``lora`` tables, -1 for
        none, or None for a step without adapters; None for a step it does not take) — or
        None where this backend has no such path for these layers. A step
        may say where its last call's time went in the mixture-of-experts layers: its
        ``moe_seconds``, (router, experts) summed over them (see ``models.moe.MoeTimer``)."""
        return None


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def no_quantized_kernels(weight: QuantizedWeight, backend: str) -> NotImplementedError:
    return NotImplementedError(f"the {backend} backend has no kernel for {weight.type_name} "
                               f"quantized weights yet")
