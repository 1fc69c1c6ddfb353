"""Paged attention in plain torch (the CPU path), planned once per step, costing what it attends.

Attention over a paged cache in torch needs each request's K/V gathered into a dense tensor,
padded to a common length for one batched SDPA call. Padding a whole batch to its longest
context made one 7,000-token request cost every short one 7,000 positions too. So requests are
grouped: decodes apart from prefill chunks, and within each kind, sorted by context length and
cut wherever a context is over twice the group's shortest. No request then pays for more than
twice its own context (plus at most a block), and the number of groups grows only with the
logarithm of the spread of lengths.

Decode rows (one query token per request) skip all of that where the C++ kernel of
``decode_attention`` is built: it reads every request's blocks in place, each for its own length, so
they form no groups at all (a long context is split over the threads inside the kernel).
Their groups are built only if a layer's shape is beyond the kernel (or it could not be built).

``plan_attention`` builds every index tensor and mask from the step's Python lists once per
step; ``attend`` runs one layer with it. A request whose blocks are consecutive and attends
alone reads its context as a view of the cache, with no copy at all.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import functools

import torch
import torch.nn.functional as F

from actorlm.kernels.cpu import decode_attention
from actorlm.kernels.metadata import padded_block_table


class _Group(NamedTuple):
    """Requests attended together: ``q_rows[b, i]`` is the token row of query i of request b."""

    q_rows: torch.Tensor | None  # [B, Lq] int64; None: the group is every row, in order
    real: torch.Tensor | None  # [B, Lq] bool, False on padded query rows; None: all real
    blocks: torch.Tensor | slice  # the cache blocks to read: [B * nb] int64, or one run of them
    num_blocks: int  # nb, per request
    seq_len: int  # positions of K/V read per request (<= nb * block_size)
    mask: torch.Tensor | None  # [B, 1, Lq, seq_len] bool; None: every position is visible
    is_decode: bool  # one query per request


class _DecodeRows(NamedTuple):
    """Every decode request of the step, for ``decode_attention.paged_decode_attention``."""

    rows: torch.Tensor | None  # [B] int32 query row of each; None: row b is request b
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    groups: Callable[[], list[_Group]]  # their groups for the torch path, if a layer needs it


class AttentionPlan(NamedTuple):
    groups: list[_Group]  # prefill chunks, and decode rows unless ``decode`` takes them
    decode: _DecodeRows | None = None


def plan_attention(q_lens: Sequence[int], seq_lens: Sequence[int],
                   block_ids: Sequence[Sequence[int]], block_size: int,
                   device: torch.device | str = "cpu",
                   tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> AttentionPlan:
    """Group the step's requests and build their index tensors and masks.

    Request b owns ``q_lens[b]`` consecutive query rows (in request order) at the last
    positions of its ``seq_lens[b]``-token context, stored in ``block_ids[b]``. ``tables``:
    the step's padded block table and seq_lens as tensors, if already built (the metadata's),
    taken as they are when every request decodes.
    """
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    requests = [b for b, q_len in enumerate(q_lens) if q_len > 0]
    decodes = [b for b in requests if q_lens[b] == 1]
    prefills = [b for b in requests if q_lens[b] != 1]
    prefill_groups = _groups(prefills, False, q_lens, seq_lens, starts, block_ids, block_size,
                             device)
    if not decodes or not decode_attention.is_built(block_size):
        return AttentionPlan(_groups(decodes, True, q_lens, seq_lens, starts, block_ids,
                                     block_size, device) + prefill_groups)
    decode_groups = functools.cache(functools.partial(  # only if a layer's shape needs them
        _groups, decodes, True, q_lens, seq_lens, starts, block_ids, block_size, device))
    return AttentionPlan(prefill_groups, _decode_rows(decodes, len(q_lens), seq_lens, starts,
                                                      block_ids, device, decode_groups, tables))


def _groups(chosen, is_decode, q_lens, seq_lens, starts, block_ids, block_size, device):
    """Requests of one kind cut into groups of similar context length."""
    chosen = sorted(chosen, key=lambda b: seq_lens[b])
    groups = []
    while chosen:
        shortest = seq_lens[chosen[0]]
        cut = next((i for i, b in enumerate(chosen) if seq_lens[b] > 2 * shortest),
                   len(chosen))
        members, chosen = chosen[:cut], chosen[cut:]
        group = _group(members, is_decode, q_lens, seq_lens, starts, block_ids, block_size,
                       device)
        if is_decode and members == list(range(len(q_lens))):
            group = group._replace(q_rows=None)  # a plain decode step: rows as they are
        groups.append(group)
    return groups


def _decode_rows(decodes, num_requests, seq_lens, starts, block_ids, device, groups, tables):
    every_row = len(decodes) == num_requests  # then row b is request b
    if every_row and tables is not None:
        return _DecodeRows(None, *tables, groups)
    return _DecodeRows(
        None if every_row else torch.tensor([starts[b] for b in decodes], dtype=torch.int32,
                                            device=device),
        padded_block_table([block_ids[b] for b in decodes], device),
        torch.tensor([seq_lens[b] for b in decodes], dtype=torch.int32, device=device), groups)


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           plan: AttentionPlan, scale: float) -> torch.Tensor:
    """query: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D] -> [T, Hq, D]. Causal: the
    query at position p sees K/V positions 0..p of its own request."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    out, groups = None, plan.groups
    if plan.decode is not None:
        if decode_attention.supports(query.dtype, num_heads, num_kv_heads, head_dim, block_size):
            d = plan.decode
            out = decode_attention.paged_decode_attention(query, k_cache, v_cache, d.block_tables,
                                                    d.seq_lens, scale, d.rows)
        else:
            groups = plan.decode.groups() + groups
    for group in groups:
        k, v = _gather(k_cache, group), _gather(v_cache, group)  # [B, Hkv, S, D]
        if group.is_decode:
            q = query if group.q_rows is None else query[group.q_rows[:, 0]]  # [B, Hq, D]
            # the G query heads of a K/V head become G query rows of it: plain attention,
            # cheaper on a CPU than SDPA's enable_gqa
            q = q.reshape(-1, num_kv_heads, num_heads // num_kv_heads, head_dim)
            o = _sdpa(q, k, v, group.mask, scale).reshape(-1, num_heads, head_dim)
            if group.q_rows is None:
                return o  # the whole step
            rows = group.q_rows[:, 0]
        else:
            q = query[group.q_rows].transpose(1, 2)  # [B, Hq, Lq, D]
            o = _sdpa(q, k, v, group.mask, scale).transpose(1, 2)  # [B, Lq, Hq, D]
            rows = group.q_rows if group.real is None else group.q_rows[group.real]
            o = o.reshape(-1, num_heads, head_dim) if group.real is None else o[group.real]
        if out is None:
            out = query.new_empty(query.shape)
        out[rows.reshape(-1)] = o
    return out if out is not None else query.new_empty(query.shape)


def _group(members, is_decode, q_lens, seq_lens, starts, block_ids, block_size, device):
    num_blocks = max(-(-seq_lens[b] // block_size) for b in members)
    longest = max(seq_lens[b] for b in members)
    if len(members) == 1:
        own = list(block_ids[members[0]][:num_blocks])
        consecutive = own == list(range(own[0], own[0] + num_blocks))
        blocks = slice(own[0], own[0] + num_blocks) if consecutive else \
            torch.tensor(own, dtype=torch.int64, device=device)
    else:
        table = [list(block_ids[b][:num_blocks]) for b in members]
        blocks = torch.tensor([i for row in table for i in row + [0] * (num_blocks - len(row))],
                              dtype=torch.int64, device=device)
    seq_lens_t = torch.tensor([seq_lens[b] for b in members], device=device)
    kv_pos = torch.arange(longest, device=device)
    if is_decode:  # one query per request, at the last position: it sees its whole context
        q_rows = torch.tensor([[starts[b]] for b in members], device=device)
        mask = None if all(seq_lens[b] == longest for b in members) else \
            (kv_pos[None, :] < seq_lens_t[:, None])[:, None, None, :]
        return _Group(q_rows, None, blocks, num_blocks, longest, mask, True)
    max_q = max(q_lens[b] for b in members)
    offsets = torch.arange(max_q, device=device)
    q_lens_t = torch.tensor([q_lens[b] for b in members], device=device)
    starts_t = torch.tensor([starts[b] for b in members], device=device)
    real = offsets[None, :] < q_lens_t[:, None]  # [B, Lq]
    # padded rows read a real row of their request, so the gather stays in bounds
    q_rows = starts_t[:, None] + torch.minimum(offsets[None, :], q_lens_t[:, None] - 1)
    q_pos = (seq_lens_t - q_lens_t)[:, None] + offsets[None, :]  # [B, Lq] absolute positions
    # a padded row's q_pos is past its context: it sees the whole of it (never an empty
    # softmax, hence no NaN), and its output is dropped
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & \
        (kv_pos[None, None, :] < seq_lens_t[:, None, None])  # [B, Lq, S]
    return _Group(q_rows, None if bool(real.all()) else real, blocks, num_blocks, longest,
                  mask[:, None], False)


def _gather(cache: torch.Tensor, group: _Group) -> torch.Tensor:
    """[B, Hkv, seq_len, D]: each request's context, a view where its blocks are one run."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    if isinstance(group.blocks, slice):
        dense = cache[group.blocks]
    else:
        # index_select copies whole blocks at memcpy speed (advanced indexing is ~1.5x slower)
        dense = cache.index_select(0, group.blocks)
    dense = dense.view(-1, group.num_blocks * block_size, num_kv_heads, head_dim)
    return dense[:, :group.seq_len].transpose(1, 2)


def _sdpa(q, k, v, mask, scale):
    """q: [B, H, Lq, D]; k, v: [B, Hkv, S, D]; mask: [B, 1, Lq, S] bool or None."""
    # In fp16/bf16, the CPU kernel (flash attention) keeps scores, softmax and sums in fp32 and
    # rounds the probabilities to the input dtype only for P @ V, as the Triton kernel does.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])
