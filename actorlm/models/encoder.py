"""Encoder-only models (BERT, RoBERTa, XLM-RoBERTa, MPNet, DistilBERT), run to embed: the
embedding models most users bring (sentence-transformers' all-MiniLM, BGE, E5 and GTE on BERT;
multilingual E5 and BGE-M3's dense vectors on XLM-RoBERTa; all-mpnet on MPNet; the msmarco and
multi-qa DistilBERTs).

Every token attends to every token of its prompt, after it as well as before, so a prompt is
computed in one step, whole: no chunked prefill and no prefix caching (a prefix's states depend
on what follows it; ``parts.resolve_runner`` turns both off), and nothing is kept between steps:
the layers read no KV cache (``KernelBackend.bidirectional_attention``), and the pool the
scheduler hands blocks from holds no bytes (``num_kv_heads`` 0). The layers are post-norm,
each branch's output joined to the stream and the sum normed (``LayerNorm(x + attention(x))``,
``LayerNorm(h + mlp(h))``), with biases everywhere; positions are learned rows (RoBERTa's
and MPNet's counted from their padding id + 1). MPNet adds to every layer's scores a bias
learned per head for each bucket of relative distance (``relative_bias``), one table for all
layers.

A ``...ForSequenceClassification`` checkpoint (a cross-encoder: ms-marco-MiniLM, BGE's
rerankers; DistilBERT's SST-2 sentiment, transformers' pipeline default) classifies through its
head over the first token's state: a dense layer, tanh (DistilBERT's: ReLU), the labels'
layer (BERT's pooler then its classifier; RoBERTa's and MPNet's classifier, dense then
``out_proj``; DistilBERT's ``pre_classifier`` then ``classifier``). BERT reads a text pair as
its tokenizer joins it, [CLS] a [SEP] b [SEP], the tokens after the first [SEP] of token type
1: so a classifier reads the types from the prompt (a single text's are all 0, unless it holds
a [SEP] of its own), and an embedding model gives every token type 0 (RoBERTa's have one
type; MPNet's and DistilBERT's none).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from actorlm.config import first_position_row
from actorlm.kernels import AttentionLayer, AttentionMetadata, KernelBackend
from actorlm.kernels.portable import ACTIVATION_FUNCTIONS
from actorlm.models.families import ACTIVATION_NAMES, activation_of, layer_windows
from actorlm.models.layers import Embedding, LayerNorm, Linear
from actorlm.models.moe_families import intermediate_size_of
from actorlm.models.parallel import TensorParallel

ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "mpnet", "distilbert", "modernbert")
# a checkpoint's names, inside a layer (``encoder.layer.N.``) -> ours (and the shard of q/k/v):
# BERT's (RoBERTa's), MPNet's, DistilBERT's
_LAYER_NAMES = {"attention.self.query.": ("qkv_proj.", 0),
                "attention.self.key.": ("qkv_proj.", 1),
                "attention.self.value.": ("qkv_proj.", 2),
                "attention.output.dense.": ("o_proj.", None),
                "attention.output.LayerNorm.": ("attn_norm.", None),
                "intermediate.dense.": ("up_proj.", None), "output.dense.": ("down_proj.", None),
                "output.LayerNorm.": ("mlp_norm.", None),
                "attention.attn.q.": ("qkv_proj.", 0), "attention.attn.k.": ("qkv_proj.", 1),
                "attention.attn.v.": ("qkv_proj.", 2), "attention.attn.o.": ("o_proj.", None),
                "attention.LayerNorm.": ("attn_norm.", None),
                # DistilBERT's (``transformer.layer.N.``)
                "attention.q_lin.": ("qkv_proj.", 0), "attention.k_lin.": ("qkv_proj.", 1),
                "attention.v_lin.": ("qkv_proj.", 2), "attention.out_lin.": ("o_proj.", None),
                "sa_layer_norm.": ("attn_norm.", None), "ffn.lin1.": ("up_proj.", None),
                "ffn.lin2.": ("down_proj.", None), "output_layer_norm.": ("mlp_norm.", None)}
_EMBEDDING_NAMES = {"embeddings.word_embeddings.": "embed_tokens.",
                    "embeddings.position_embeddings.": "embed_positions.",
                    "embeddings.token_type_embeddings.": "token_types.",
                    "embeddings.LayerNorm.": "embed_norm.",
                    "encoder.relative_attention_bias.": "relative_bias."}
# a classifier's head -> ours: BERT's pooler and classifier, RoBERTa's and MPNet's classifier,
# DistilBERT's pre_classifier and classifier
_HEAD_NAMES = {"pooler.dense.": "score.dense.", "classifier.dense.": "score.dense.",
               "pre_classifier.": "score.dense.", "classifier.out_proj.": "score.out.",
               "classifier.": "score.out."}
# what no model here reads: a masked-LM's head, the position ids older checkpoints saved (and
# an embedding model reads no classifier's head: BERT's pooler, sentence-transformers pools)
_UNREAD = ("cls.", "lm_head.", "embeddings.position_ids")


def is_encoder(config) -> bool:
    return getattr(config, "model_type", None) in ENCODER_MODEL_TYPES


def attends_both_ways(config) -> bool:
    """Whether every token attends to its whole prompt, so that a prompt runs in one step,
    whole, and nothing is cached: an encoder, or a decoder made one (EmbeddingGemma)."""
    return is_encoder(config) or bool(getattr(config, "use_bidirectional_attention", False))


def cache_windows(config) -> list[int | None]:
    """Each layer's window as the KV cache sees it (``kv_groups``): a model attending both
    ways keeps no cache, whatever its windows, so one group of them all."""
    return [None] * config.num_hidden_layers if attends_both_ways(config) else \
        layer_windows(config)


def encoder_class(config) -> type[Encoder]:
    """The model class of an encoder's config."""
    if config.model_type == "modernbert":
        from actorlm.models.modernbert import ModernBertModel

        return ModernBertModel
    return EncoderModel


def check_encoder(config, pooling: str | None, tp: TensorParallel) -> None:
    """Refuse, by name, what an encoder is asked for and this engine does not compute."""
    name = config.model_type
    if pooling is None:
        raise ValueError(f"{name} is an encoder: it runs to embed or classify (--runner "
                         f"pooling); generating text is not implemented")
    if tp.is_parallel:
        raise ValueError(f"{name}: tensor parallelism of an encoder is not implemented")
    position = getattr(config, "position_embedding_type", "absolute")
    if position != "absolute":
        raise ValueError(f"{name}: position_embedding_type={position!r} is not implemented "
                         f"(absolute)")
    for field in ("is_decoder", "add_cross_attention"):
        if getattr(config, field, False):
            raise ValueError(f"{name}: {field}=True is not implemented (an encoder's layers)")
    buckets = getattr(config, "relative_attention_num_buckets", 32)
    if name == "mpnet" and buckets != 32:
        raise ValueError(f"{name}: relative_attention_num_buckets={buckets} is not implemented "
                         f"(32, by which transformers buckets the distances whatever it says)")
    for layer_type, rope in (config.rope_parameters.items() if name == "modernbert" else ()):
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{name}: the {layer_type} layers' rope_type "
                             f"{rope.get('rope_type')!r} is not implemented (default)")
    if getattr(config, "sinusoidal_pos_embds", False):
        raise ValueError(f"{name}: sinusoidal_pos_embds=True is not implemented (learned "
                         f"positions)")
    if ACTIVATION_NAMES.get(activation_of(config)) not in ACTIVATION_FUNCTIONS:
        raise ValueError(f"{name}: hidden_act={activation_of(config)!r} is not implemented (one "
                         f"of {', '.join(ACTIVATION_NAMES)})")


class EncoderLayer(nn.Module):
    """``h = norm(x + o(attention(qkv(x))))``, ``out = norm(h + down(act(up(h))))``."""

    def __init__(self, config, backend: KernelBackend, dtype, device):
        super().__init__()
        hidden, heads, eps = config.hidden_size, config.num_attention_heads, _norm_eps(config)
        head_dim = hidden // heads
        self.backend, self.activation = backend, activation_function(activation_of(config))
        self.attention = AttentionLayer(heads, heads, head_dim, head_dim**-0.5)
        self.qkv_proj = Linear(hidden, 3 * hidden, True, dtype, device)
        self.o_proj = Linear(hidden, hidden, True, dtype, device)
        self.attn_norm = LayerNorm(hidden, eps, True, dtype, device)
        intermediate = intermediate_size_of(config)
        self.up_proj = Linear(hidden, intermediate, True, dtype, device)
        self.down_proj = Linear(intermediate, hidden, True, dtype, device)
        self.mlp_norm = LayerNorm(hidden, eps, True, dtype, device)

    def forward(self, x: torch.Tensor, query_start_loc: Sequence[int],
                score_bias: Callable[[int], torch.Tensor] | None) -> torch.Tensor:
        attended = self.backend.bidirectional_attention(self.qkv_proj(x), query_start_loc,
                                                        self.attention, score_bias)
        h = self.attn_norm(self.o_proj(attended), x)[0]
        return self.mlp_norm(self.down_proj(self.activation(self.up_proj(h))), h)[0]


class ClassifierHead(nn.Module):
    """``out(act(dense(state)))`` over a prompt's first token's state: tanh, or DistilBERT's
    ReLU."""

    def __init__(self, hidden: int, num_labels: int, activation: Callable, dtype, device):
        super().__init__()
        self.activation = activation
        self.dense = Linear(hidden, hidden, True, dtype, device)
        self.out = Linear(hidden, num_labels, True, dtype, device)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return self.out(self.activation(self.dense(state)))


class Encoder(nn.Module):
    """What the runner asks of an encoder (``CausalLM``'s surface where a pooling model uses
    it: the step's tokens -> their last layer's states, [T, hidden]) and how its checkpoint
    loads; a family gives its modules, ``forward`` and ``checkpoint_name``."""

    def __init__(self, config, backend: KernelBackend, dtype: torch.dtype, device,
                 tp: TensorParallel, pooling: str | None):
        super().__init__()
        check_encoder(config, pooling, tp)
        self.config, self.backend, self.dtype, self.device = config, backend, dtype, device
        self.tp = tp  # (one rank)
        self.num_layers = config.num_hidden_layers
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_kv_heads = 0  # nothing is cached: the KV pool's pages hold no bytes
        self.score: nn.Module | None = None  # a classifier's head (the pooler runs it)

    qkv_split = True  # the checkpoint's q, k and v are three tensors (ModernBERT's one)

    def rope_rows(self, start: int, end: int, num_prompt_tokens: int) -> Sequence[int]:
        return range(start, end)  # (the positions as they are)

    def checkpoint_name(self, name: str) -> tuple[str | None, int | None]:
        """(our parameter's name, the q/k/v shard) of a checkpoint tensor; (None, None): not
        read."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy the checkpoint's tensors in (a ``BertModel``'s names, or a task model's with
        ``bert.``, ``roberta.``... before them), raising if any is left unset, then hand the
        linear layers to the backend."""
        params = dict(self.named_parameters())
        split = self.qkv_split
        missing = {f"{name}#{i}" if split and ".qkv_proj." in name else name for name in params
                   for i in (range(3) if split and ".qkv_proj." in name else (0,))}
        hidden = self.config.hidden_size
        for name, tensor in weights:
            target, shard = self.checkpoint_name(name)
            if target is None:
                continue
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            dst = params[target]
            if shard is not None:
                dst = dst.narrow(0, shard * hidden, hidden)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(tensor.to(dtype=dst.dtype, device=dst.device))
            missing.discard(target if shard is None else f"{target}#{shard}")
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)}")
        for module in self.modules():
            if isinstance(module, (Linear, Embedding)):
                module.prepare(self.backend)


class EncoderModel(Encoder):
    """BERT, RoBERTa, XLM-RoBERTa, MPNet, DistilBERT."""

    def __init__(self, config, backend: KernelBackend, dtype: torch.dtype = torch.float32,
                 device=None, tp: TensorParallel = TensorParallel(), pooling: str | None = None):
        super().__init__(config, backend, dtype, device, tp, pooling)
        hidden = config.hidden_size
        self.first_position = first_position_row(config)
        self.embed_tokens = Embedding(config.vocab_size, hidden, dtype, device)
        self.embed_positions = Embedding(config.max_position_embeddings, hidden, dtype, device)
        # (MPNet's tokens have no types; its relative distances a bias per head and bucket)
        types = getattr(config, "type_vocab_size", 0)
        self.token_types = Embedding(types, hidden, dtype, device) if types else None
        buckets = getattr(config, "relative_attention_num_buckets", 0)
        self.relative_bias = Embedding(buckets, config.num_attention_heads, dtype, device) \
            if config.model_type == "mpnet" else None
        self.embed_norm = LayerNorm(hidden, _norm_eps(config), True, dtype, device)
        self.layers = nn.ModuleList(EncoderLayer(config, backend, dtype, device)
                                    for _ in range(self.num_layers))
        if pooling == "classify":
            self.score = ClassifierHead(hidden, config.num_labels, torch.relu if
                                        config.model_type == "distilbert" else torch.tanh,
                                        dtype, device)
        # a classifier's: the token after which a pair's second text begins (BERT's [SEP]),
        # where the model has a second token type (an embedding model reads single texts)
        self.separator = _separator(config) if pooling == "classify" and types > 1 else None

    def forward(self, input_ids, positions, kv_caches,
                metas: Sequence[AttentionMetadata]) -> torch.Tensor:
        """input_ids, positions: [T] int64; every request's prompt whole (``kv_caches`` are
        not read) -> [T, hidden]."""
        starts = metas[0].query_start_loc.tolist()
        # transformers' order: the token's row plus its type's, then plus its position's
        x = self.embed_tokens(input_ids)
        if self.token_types is not None:
            x = x + self.token_types(self.token_type_ids(input_ids, starts))
        x = self.embed_norm(x + self.embed_positions(positions + self.first_position))
        score_bias = None if self.relative_bias is None else \
            functools.cache(self._relative_bias)  # (per length, once a step for all layers)
        for layer in self.layers:
            x = layer(x, starts, score_bias)
        return x

    def _relative_bias(self, length: int) -> torch.Tensor:
        """MPNet's bias [heads, length, length] of each query's distance to each key."""
        positions = torch.arange(length, device=self.relative_bias.weight.device)
        buckets = relative_position_bucket(positions[None, :] - positions[:, None])
        return self.relative_bias(buckets).permute(2, 0, 1)

    def token_type_ids(self, input_ids: torch.Tensor, starts: Sequence[int]) -> torch.Tensor:
        """Each token's type: 1 after the first separator of its prompt (a pair's second
        text, as BERT's tokenizer types it), else 0."""
        types = torch.zeros_like(input_ids)
        if self.separator is None:
            return types
        separators = (input_ids == self.separator).nonzero().flatten().tolist()
        for begin, end in zip(starts, starts[1:]):
            first = next((i for i in separators if begin <= i < end), None)
            if first is not None:
                types[first + 1:end] = 1
        return types

    def checkpoint_name(self, name: str) -> tuple[str | None, int | None]:
        return _our_name(name, classifies=self.score is not None)


def activation_function(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A config's activation as transformers computes it."""
    return ACTIVATION_FUNCTIONS[ACTIVATION_NAMES[name]]


def _norm_eps(config) -> float:
    return getattr(config, "layer_norm_eps", 1e-12)  # (DistilBERT's, fixed)


def relative_position_bucket(distance: torch.Tensor, num_buckets: int = 32,
                             max_distance: int = 128) -> torch.Tensor:
    """MPNet's (T5's) bucket of each key-minus-query distance: half the buckets for keys
    before the query, half after; the first half of each exact (0-7), then logarithmic up
    to ``max_distance``. transformers buckets by 32 whatever the config's count."""
    half = num_buckets // 2
    n = -distance
    bucket = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    large = exact + (torch.log(n.float() / exact) / math.log(max_distance / exact)
                     * (half - exact)).long()
    return bucket + torch.where(n < exact, n, large.clamp(max=half - 1))


def _separator(config) -> int | None:
    """The id of the model's [SEP] token, from its tokenizer's files beside the config."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config._name_or_path).sep_token_id


def _our_name(name: str, classifies: bool) -> tuple[str | None, int | None]:
    """(our parameter's name, the q/k/v shard) of a checkpoint tensor; (None, None): not read."""
    for prefix in ("bert.", "roberta.", "mpnet.", "distilbert.", "model."):
        name = name.removeprefix(prefix)
    for fragment, ours in _HEAD_NAMES.items():
        if name.startswith(fragment):
            return (ours + name.removeprefix(fragment), None) if classifies else (None, None)
    if name.startswith(_UNREAD):
        return None, None
    # (checkpoints from before PyTorch named LayerNorm's parameters weight and bias)
    name = name.removesuffix(".gamma") + ".weight" if name.endswith(".gamma") else \
        name.removesuffix(".beta") + ".bias" if name.endswith(".beta") else name
    for fragment, ours in _EMBEDDING_NAMES.items():
        if name.startswith(fragment):
            return ours + name.removeprefix(fragment), None
    if name.startswith(("encoder.layer.", "transformer.layer.")):
        index, _, rest = name.split(".layer.", 1)[1].partition(".")
        for fragment, (ours, shard) in _LAYER_NAMES.items():
            if rest.startswith(fragment):
                return f"layers.{index}.{ours}{rest.removeprefix(fragment)}", shard
    return name, None
