"""ModernBERT, run to embed or classify: the newer encoder of gte-modernbert, modernbert-embed
and the ModernBERT rerankers, an encoder as ``encoder.py`` runs one (each prompt whole in
one step, nothing cached), with a decoder's parts.

Pre-norm layers (the first without a norm before its attention), LayerNorms without biases,
no biases on the projections (``attention_bias``, ``mlp_bias``, ``norm_bias`` say), a gated
MLP (act(first half of ``Wi``) times its second half), and RoPE in place of learned
positions: the global layers turn q and k by one base, the local ones by another, and the
local ones see the keys at most ``sliding_window`` positions away, either side
(``local_attention`` / 2). A final norm after the last layer. A classifier pools by
``classifier_pooling`` and runs its head: dense, act, norm, then the labels' layer.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from actorlm.kernels import AttentionLayer, AttentionMetadata, KernelBackend
from actorlm.kernels.portable import turn_qk
from actorlm.models.causal_lm import rope_table
from actorlm.models.encoder import Encoder, activation_function
from actorlm.models.families import ACTIVATION_NAMES
from actorlm.models.layers import Embedding, LayerNorm, Linear
from actorlm.models.parallel import TensorParallel

# the checkpoint's names (after ``model.``) -> ours: a layer's, then the rest's
_LAYER_NAMES = {"attn.Wqkv.": "qkv_proj.", "attn.Wo.": "o_proj.", "mlp.Wi.": "gate_up_proj.",
                "mlp.Wo.": "down_proj.", "attn_norm.": "attn_norm.", "mlp_norm.": "mlp_norm."}
_NAMES = {"embeddings.tok_embeddings.": "embed_tokens.", "embeddings.norm.": "embed_norm.",
          "final_norm.": "final_norm."}
_HEAD_NAMES = {"head.dense.": "score.dense.", "head.norm.": "score.norm.",
               "classifier.": "score.out."}
_UNREAD = ("decoder.", "head.", "classifier.")  # a masked-LM's head; a classifier's, embedding


class ModernBertLayer(nn.Module):
    def __init__(self, config, index: int, backend: KernelBackend, dtype, device):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // heads
        local = config.layer_types[index] == "sliding_attention"
        self.backend, self.local = backend, local
        self.attention = AttentionLayer(heads, heads, head_dim, head_dim**-0.5,
                                        config.sliding_window if local else None)
        self.activation = ACTIVATION_NAMES[config.hidden_activation]  # (the kernels' name)
        self.attn_norm = None if index == 0 else _norm(config, dtype, device)
        self.qkv_proj = Linear(hidden, 3 * hidden, config.attention_bias, dtype, device)
        self.o_proj = Linear(hidden, hidden, config.attention_bias, dtype, device)
        self.mlp_norm = _norm(config, dtype, device)
        self.gate_up_proj = Linear(hidden, 2 * config.intermediate_size, config.mlp_bias,
                                   dtype, device)
        self.down_proj = Linear(config.intermediate_size, hidden, config.mlp_bias, dtype, device)

    def forward(self, x, starts: Sequence[int], rope: tuple[torch.Tensor, torch.Tensor]):
        qkv = self.qkv_proj(x if self.attn_norm is None else self.attn_norm(x))
        turn_qk(qkv, *rope, self.attention)
        x = x + self.o_proj(self.backend.bidirectional_attention(qkv, starts, self.attention))
        gate_up = self.gate_up_proj(self.mlp_norm(x))
        return x + self.down_proj(self.backend.act_and_mul(gate_up, self.activation))


class ClassifierHead(nn.Module):
    """``out(norm(act(dense(pooled))))``."""

    def __init__(self, config, dtype, device):
        super().__init__()
        hidden = config.hidden_size
        self.activation = activation_function(config.classifier_activation)
        self.dense = Linear(hidden, hidden, config.classifier_bias, dtype, device)
        self.norm = _norm(config, dtype, device)
        self.out = Linear(hidden, config.num_labels, True, dtype, device)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.activation(self.dense(pooled))))


class ModernBertModel(Encoder):
    qkv_split = False

    def __init__(self, config, backend: KernelBackend, dtype: torch.dtype = torch.float32,
                 device=None, tp: TensorParallel = TensorParallel(), pooling: str | None = None):
        super().__init__(config, backend, dtype, device, tp, pooling)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.embed_norm = _norm(config, dtype, device)
        self.layers = nn.ModuleList(ModernBertLayer(config, i, backend, dtype, device)
                                    for i in range(self.num_layers))
        self.final_norm = _norm(config, dtype, device)
        if pooling == "classify":
            self.score = ClassifierHead(config, dtype, device)
        # (cos, sin_signed) [positions, D] of the global layers' base and the local ones'
        self.ropes = {local: rope_table(config, "sliding_attention" if local else
                                        "full_attention", config.max_position_embeddings, None,
                                        dtype, device)
                      for local in (False, True)}

    def forward(self, input_ids, positions, kv_caches,
                metas: Sequence[AttentionMetadata]) -> torch.Tensor:
        """input_ids, positions: [T] int64, every request's prompt whole -> [T, hidden]."""
        starts = metas[0].query_start_loc.tolist()
        ropes = {local: (cos[positions][:, None], sin[positions][:, None])
                 for local, (cos, sin) in self.ropes.items()}
        x = self.embed_norm(self.embed_tokens(input_ids))
        for layer in self.layers:
            x = layer(x, starts, ropes[layer.local])
        return self.final_norm(x)

    def checkpoint_name(self, name: str) -> tuple[str | None, int | None]:
        name = name.removeprefix("model.")
        for fragment, ours in _HEAD_NAMES.items():
            if name.startswith(fragment) and self.score is not None:
                return ours + name.removeprefix(fragment), None
        if name.startswith(_UNREAD):
            return None, None
        for fragment, ours in _NAMES.items():
            if name.startswith(fragment):
                return ours + name.removeprefix(fragment), None
        if name.startswith("layers."):
            index, _, rest = name.removeprefix("layers.").partition(".")
            for fragment, ours in _LAYER_NAMES.items():
                if rest.startswith(fragment):
                    return f"layers.{index}.{ours}{rest.removeprefix(fragment)}", None
        return name, None


def _norm(config, dtype, device) -> LayerNorm:
    return LayerNorm(config.hidden_size, config.norm_eps, config.norm_bias, dtype, device)
