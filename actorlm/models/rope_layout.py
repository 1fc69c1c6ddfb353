"""Where each of a head's q and k features sits for the rotation the kernels compute.

The kernels rotate a head's features j and j + D/2 together (Llama's halves) by the angle of a
RoPE table's frequency j. Two other layouts are that rotation on other pairs: interleaved
pairs (2i, 2i + 1: GLM's) and RoPE on the first R features only, the rest passed through
(partial rotary: GLM's half, Phi-4-mini's three quarters). Both become Llama's halves by one
reordering of each head's q and k features, taken at load (weights, biases, q/k norms, a LoRA
adapter's rows of them): q and k reordered alike leave every score q.k as it was, and v and
the attention's output are untouched. The features left unrotated get a table frequency of 0
(cos 1, sin 0), which leaves them exactly as they are.
"""

from __future__ import annotations

import torch

from actorlm.kernels import QuantizedWeight

ROTATED_Q_K = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "q_norm.weight",
               "k_norm.weight", "q_norm.bias", "k_norm.bias")  # rows that follow a head's features


def head_order(head_dim: int, rotary_dim: int, interleaved: bool) -> tuple[int, ...] | None:
    """Our feature j of a head is the checkpoint's feature ``order[j]``; None: the same
    order (RoPE on every feature, in halves)."""
    if rotary_dim == head_dim and not interleaved:
        return None
    if not 0 <= rotary_dim <= head_dim:
        raise ValueError(f"RoPE on {rotary_dim} of a head's {head_dim} features "
                         f"(partial_rotary_factor): it must turn 0 to {head_dim} of them")
    if rotary_dim % 2 or head_dim % 2:
        raise ValueError(f"RoPE on {rotary_dim} of a head's {head_dim} features: both must be "
                         f"even")
    if interleaved:
        first, second = range(0, rotary_dim, 2), range(1, rotary_dim, 2)
    else:
        first, second = range(rotary_dim // 2), range(rotary_dim // 2, rotary_dim)
    passed = range(rotary_dim, head_dim)
    half = len(passed) // 2
    return (*first, *passed[:half], *second, *passed[half:])


def reordered(tensor, order: tuple[int, ...] | None, head_dim: int):
    """``tensor``'s rows (whole heads of ``head_dim`` features, or one head's norm) each head
    in ``order``: a tensor, or a weight in blocks (whose rows never share a block)."""
    if order is None:
        return tensor
    heads = tensor.shape[0] // head_dim
    index = (torch.arange(heads)[:, None] * head_dim + torch.tensor(order)[None]).flatten()
    if isinstance(tensor, QuantizedWeight):
        return QuantizedWeight(tensor.type_name, tensor.blocks.index_select(0, index),
                               tensor.shape)
    return tensor.index_select(0, index.to(tensor.device))
