"""A pooling model's last step of a request: its prompt's final hidden states into one vector.

The prompt may prefill over several steps (chunked prefill): the mean is summed chunk by chunk
(in fp32) and divided once the prompt is complete; the first token's state is kept from the
chunk that starts the prompt; the last token's is in the step that completes it. A
classifier's pooled state then goes through its score head, and its logits through a softmax
(a sigmoid for one label), as vLLM's classify does. Under tensor parallelism every rank holds
the whole hidden state, and rank 0 pools (``ModelRunner``).
"""

from __future__ import annotations

import pathlib

import torch

from actorlm.pooling import PoolerConfig, PoolingParams, Projection


class PooledState:
    """What a request's earlier chunks left for its pooling (the runner holds one per
    request)."""

    __slots__ = ("total", "first")

    def __init__(self):
        self.total: torch.Tensor | None = None  # MEAN: the sum over the tokens so far
        self.first: torch.Tensor | None = None  # CLS: the first token's state


class Pooler:
    """``head``: a classifier's score head (``CausalLM.score``), fed in ``dtype``; the model's
    sentence-transformers projections (``PoolerConfig.projections``) run in ``dtype`` too, as
    sentence-transformers runs them in the model's."""

    def __init__(self, config: PoolerConfig, head=None, dtype: torch.dtype = torch.float32):
        self.config, self.head, self.dtype = config, head, dtype
        self.projections = [_projection(p, dtype) for p in config.projections]

    def add_chunk(self, state: PooledState, rows: torch.Tensor, starts_prompt: bool) -> None:
        """``rows``: [n, hidden] of one request's chunk, in order."""
        kind = self.config.pooling_type
        if kind == "MEAN":
            total = rows.float().sum(0)
            state.total = total if state.total is None else state.total + total
        elif kind == "CLS" and starts_prompt:
            state.first = rows[0].float()

    def finish(self, state: PooledState, last_row: torch.Tensor, num_tokens: int,
               params: PoolingParams) -> bytes:
        """The request's embedding (float32 bytes) once its last chunk has been added."""
        kind = self.config.pooling_type
        vector = last_row.float() if kind == "LAST" else \
            state.total / num_tokens if kind == "MEAN" else state.first
        if self.head is not None:
            return _probabilities(self.head(vector[None].to(self.dtype))[0].float(),
                                  params.use_activation is not False)
        for projection in self.projections:
            vector = projection(vector.to(self.dtype)).float()
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        if self.config.normalizes(params):
            vector = torch.nn.functional.normalize(vector, dim=-1)
        return vector.cpu().numpy().tobytes()


def _probabilities(logits: torch.Tensor, activate: bool) -> bytes:
    if activate:
        logits = logits.softmax(-1) if logits.numel() > 1 else logits.sigmoid()
    return logits.cpu().numpy().tobytes()


# a Dense module's activation (``pooling.Projection.activation``)
_ACTIVATIONS = {"identity": lambda x: x, "tanh": torch.tanh, "relu": torch.relu,
                "gelu": torch.nn.functional.gelu, "sigmoid": torch.sigmoid}


def _projection(projection: Projection, dtype: torch.dtype):
    """``vector -> act(vector @ weight.T + bias)`` over a Dense module's weights, read from its
    ``model.safetensors`` (or an older ``pytorch_model.bin``)."""
    directory = pathlib.Path(projection.directory)
    file = directory / "model.safetensors"
    if file.is_file():
        from safetensors.torch import load_file

        tensors = load_file(file)
    else:
        tensors = torch.load(directory / "pytorch_model.bin", map_location="cpu",
                             weights_only=True)
    weight = tensors["linear.weight"].to(dtype)
    if tuple(weight.shape) != (projection.out_features, projection.in_features):
        raise ValueError(f"{str(directory)!r}: linear.weight has shape {tuple(weight.shape)}, "
                         f"expected {(projection.out_features, projection.in_features)}")
    bias = tensors["linear.bias"].to(dtype) if projection.bias else None
    act = _ACTIVATIONS[projection.activation]
    return lambda vector: act(torch.nn.functional.linear(
        vector, weight.to(vector.device), None if bias is None else bias.to(vector.device)))
