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

A sliding window changes what each request reads, so a window's groups are planned apart, on
the first layer that has it, and kept for the step's other layers (``AttentionPlan.windowed``).
They read from the block of the earliest position any of the request's queries sees: the
blocks before it are the allocator's to free and reuse (their table entries may name any
block, another request's or a placeholder), so they are never read, not merely masked — a
masked NaN still poisons SDPA's sums — and a 4,000-token context read through a window of 16
costs its last blocks only.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import functools

import torch
import torch.nn.functional as F

from actorlm.kernels.cpu import decode_attention, fused
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
    # the plan of a sliding window (None where the window changes nothing), built on first use
    windowed: Callable[[int], AttentionPlan | None] | None = None


class _Step(NamedTuple):
    """The step's lists, as ``plan_attention`` was given them."""

    q_lens: Sequence[int]
    seq_lens: Sequence[int]
    starts: list[int]  # the first query row of each request
    block_ids: Sequence[Sequence[int]]
    block_size: int
    device: torch.device | str


class _Memo:
    """``fn(*args)``, computed on the first call with those args: ``functools.cache``'s job at
    a tenth of its cost to create (3 us), which a step's plan would pay for each of its two."""

    __slots__ = ("fn", "results")

    def __init__(self, fn: Callable):
        self.fn, self.results = fn, {}

    def __call__(self, *args):
        if args not in self.results:
            self.results[args] = self.fn(*args)
        return self.results[args]


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
    step = _Step(q_lens, seq_lens, starts, block_ids, block_size, device)
    full = _plan(step, None, tables)
    return AttentionPlan(full.groups, full.decode,
                         _Memo(functools.partial(_windowed_plan, step, full.decode)))


def _windowed_plan(step: _Step, decode: _DecodeRows | None, window: int) -> AttentionPlan | None:
    if max(step.seq_lens, default=0) <= window:  # every query sees its whole context
        return None
    return _plan(step, window, decode=decode)


def _plan(step: _Step, window: int | None, tables=None,
          decode: _DecodeRows | None = None) -> AttentionPlan:
    """The step's groups for ``window``; ``decode``: the decode rows of the full plan, which
    the kernel reads whatever the window (the window is the kernel's argument)."""
    requests = [b for b, q_len in enumerate(step.q_lens) if q_len > 0]
    decodes = [b for b in requests if step.q_lens[b] == 1]
    prefills = [b for b in requests if step.q_lens[b] != 1]
    prefill_groups = _groups(prefills, False, step, window)
    if not decodes or not decode_attention.is_built(step.block_size):
        return AttentionPlan(_groups(decodes, True, step, window) + prefill_groups)
    decode_groups = _Memo(functools.partial(  # only if a layer's shape needs them
        _groups, decodes, True, step, window))
    if decode is None:
        return AttentionPlan(prefill_groups, _decode_rows(decodes, step, decode_groups, tables))
    return AttentionPlan(prefill_groups, decode._replace(groups=decode_groups))


def _first_read(b: int, step: _Step, window: int | None) -> int:
    """The first position request b reads: where the window of its earliest query starts,
    rounded down to its block (that block holds a visible position, so it is the request's)."""
    if window is None:
        return 0
    first_seen = max(0, step.seq_lens[b] - step.q_lens[b] - window + 1)
    return first_seen - first_seen % step.block_size


def _groups(chosen, is_decode, step: _Step, window):
    """Requests of one kind cut into groups of similar length read."""
    firsts = {b: _first_read(b, step, window) for b in chosen}
    chosen = sorted(chosen, key=lambda b: step.seq_lens[b] - firsts[b])
    groups = []
    while chosen:
        shortest = step.seq_lens[chosen[0]] - firsts[chosen[0]]
        cut = next((i for i, b in enumerate(chosen)
                    if step.seq_lens[b] - firsts[b] > 2 * shortest), len(chosen))
        members, chosen = chosen[:cut], chosen[cut:]
        group = _group(members, [firsts[b] for b in members], is_decode, step, window)
        if is_decode and members == list(range(len(step.q_lens))):
            group = group._replace(q_rows=None)  # a plain decode step: rows as they are
        groups.append(group)
    return groups


def _decode_rows(decodes, step: _Step, groups, tables):
    every_row = len(decodes) == len(step.q_lens)  # then row b is request b
    if every_row and tables is not None:
        return _DecodeRows(None, *tables, groups)
    device = step.device
    return _DecodeRows(
        None if every_row else torch.tensor([step.starts[b] for b in decodes],
                                            dtype=torch.int32, device=device),
        padded_block_table([step.block_ids[b] for b in decodes], device),
        torch.tensor([step.seq_lens[b] for b in decodes], dtype=torch.int32, device=device),
        groups)


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           plan: AttentionPlan, scale: float, window: int | None = None,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D] -> [T, Hq, D]. Causal: the
    query at position p sees K/V positions 0..p of its own request (with a ``window``, those
    past p - window); a ``softcap`` caps the scaled scores at ``softcap * tanh(s / softcap)``;
    ``sinks`` [Hq] join each head's softmax denominator (GPT-OSS), on the torch path."""
    if window is not None and plan.windowed is not None:
        plan = plan.windowed(window) or plan
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    out, groups = None, plan.groups
    if plan.decode is not None:
        if sinks is None and decode_attention.supports(query.dtype, num_heads, num_kv_heads,
                                                       head_dim, block_size, k_cache.dtype):
            d = plan.decode
            out = decode_attention.paged_decode_attention(
                query, k_cache, v_cache, d.block_tables, d.seq_lens, scale, d.rows,
                window=window, softcap=softcap)
        else:
            groups = plan.decode.groups() + groups
    for group in groups:
        # [B, Hkv, S, D]; an FP8 cache's values widened (exactly) to the query's dtype
        k, v = _gather(k_cache, group, query.dtype), _gather(v_cache, group, query.dtype)
        if group.is_decode:
            q = query if group.q_rows is None else query[group.q_rows[:, 0]]  # [B, Hq, D]
            # the G query heads of a K/V head become G query rows of it: plain attention,
            # cheaper on a CPU than SDPA's enable_gqa
            q = q.reshape(-1, num_kv_heads, num_heads // num_kv_heads, head_dim)
            o = _sdpa(q, k, v, group.mask, scale, softcap, sinks).reshape(-1, num_heads,
                                                                           head_dim)
            if group.q_rows is None:
                return o  # the whole step
            rows = group.q_rows[:, 0]
        else:
            q = query[group.q_rows].transpose(1, 2)  # [B, Hq, Lq, D]
            o = _sdpa(q, k, v, group.mask, scale, softcap, sinks).transpose(1, 2)  # [B, Lq, Hq, D]
            rows = group.q_rows if group.real is None else group.q_rows[group.real]
            o = o.reshape(-1, num_heads, head_dim) if group.real is None else o[group.real]
        if out is None:
            out = query.new_empty(query.shape)
        out[rows.reshape(-1)] = o
    return out if out is not None else query.new_empty(query.shape)


def _group(members, firsts, is_decode, step: _Step, window):
    """Requests attended together, request b reading its context from position firsts[b] (on
    a block boundary)."""
    block_size, device = step.block_size, step.device
    seq_lens = [step.seq_lens[b] for b in members]
    longest = max(s - f for s, f in zip(seq_lens, firsts))  # positions read per request
    num_blocks = -(-longest // block_size)
    # each request's own blocks, from its first read; a shorter one is padded with its own
    # first block (one it reads: never a freed one), whose padding positions are masked
    own = [list(step.block_ids[b][f // block_size:-(-s // block_size)])
           for b, f, s in zip(members, firsts, seq_lens)]
    if len(members) == 1:
        consecutive = own[0] == list(range(own[0][0], own[0][0] + num_blocks))
        blocks = slice(own[0][0], own[0][0] + num_blocks) if consecutive else \
            torch.tensor(own[0], dtype=torch.int64, device=device)
    else:
        blocks = torch.tensor([i for row in own for i in row + row[:1] * (num_blocks - len(row))],
                              dtype=torch.int64, device=device)
    seq_lens_t = torch.tensor(seq_lens, device=device)
    kv_pos = torch.arange(longest, device=device)  # [S], from each request's first read
    if window is not None:
        kv_pos = torch.tensor(firsts, device=device)[:, None] + kv_pos  # [B, S] absolute
    if is_decode:  # one query per request, at the last position: it sees its whole context
        q_rows = torch.tensor([[step.starts[b]] for b in members], device=device)
        mask = None
        if window is not None:  # ... or the last ``window`` positions of it
            mask = (kv_pos < seq_lens_t[:, None]) & (kv_pos >= seq_lens_t[:, None] - window)
        elif any(s != longest for s in seq_lens):
            mask = kv_pos[None, :] < seq_lens_t[:, None]
        return _Group(q_rows, None, blocks, num_blocks, longest,
                      None if mask is None else mask[:, None, None, :], True)
    q_lens = [step.q_lens[b] for b in members]
    offsets = torch.arange(max(q_lens), device=device)
    q_lens_t = torch.tensor(q_lens, device=device)
    starts_t = torch.tensor([step.starts[b] for b in members], device=device)
    real = offsets[None, :] < q_lens_t[:, None]  # [B, Lq]
    # padded rows repeat their request's last real row (in bounds, never an empty softmax,
    # hence no NaN); their outputs are dropped
    clamped = torch.minimum(offsets[None, :], q_lens_t[:, None] - 1)
    q_rows = starts_t[:, None] + clamped
    q_pos = (seq_lens_t - q_lens_t)[:, None] + clamped  # [B, Lq] absolute positions
    kv_pos = kv_pos.expand(len(members), longest)[:, None, :]  # [B, 1, S]
    mask = kv_pos <= q_pos[:, :, None]  # [B, Lq, S]; past the context too, as q_pos is in it
    if window is not None:
        mask &= kv_pos > q_pos[:, :, None] - window
    return _Group(q_rows, None if bool(real.all()) else real, blocks, num_blocks, longest,
                  mask[:, None], False)


def _gather(cache: torch.Tensor, group: _Group, dtype: torch.dtype) -> torch.Tensor:
    """[B, Hkv, seq_len, D] in ``dtype``: each request's context, a view where its blocks are
    one run (and the cache holds ``dtype``: an FP8 cache's are widened)."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    if isinstance(group.blocks, slice):
        dense = cache[group.blocks]
    else:
        # index_select copies whole blocks at memcpy speed (advanced indexing is ~1.5x slower)
        dense = cache.index_select(0, group.blocks)
    dense = fused.widened(dense, dtype)
    dense = dense.view(-1, group.num_blocks * block_size, num_kv_heads, head_dim)
    return dense[:, :group.seq_len].transpose(1, 2)


def _sdpa(q, k, v, mask, scale, softcap=None, sinks=None):
    """q: [B, H, Lq, D]; k, v: [B, Hkv, S, D]; mask: [B, 1, Lq, S] bool or None. (A decode
    group's q holds a KV head's G query heads as its G rows: [B, Hkv, G, D].)"""
    if softcap is not None or sinks is not None:
        return _written_out(q, k, v, mask, scale, softcap, sinks)
    # In fp16/bf16, the CPU kernel (flash attention) keeps scores, softmax and sums in fp32 and
    # rounds the probabilities to the input dtype only for P @ V, as the Triton kernel does.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _written_out(q, k, v, mask, scale, softcap, sinks):
    """``_sdpa`` with the scores capped or sinks in the softmax, which SDPA has no option for:
    in fp32 throughout (P too), rounded once to q's dtype."""
    batch, num_heads, num_queries, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # a KV head's G query heads as G * Lq rows of it (head h reads KV head h // G)
    rows = q.float().reshape(batch, num_kv_heads, group * num_queries, head_dim)
    scores = rows @ k.float().transpose(-1, -2) * scale  # [B, Hkv, G Lq, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(batch, num_kv_heads, group, num_queries, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:  # one more score per head, which no value goes with; a decode group's rows are
        # its query heads (then the last dimension but one is theirs, not 1)
        sink = sinks.float().view(1, num_kv_heads, group, -1, 1).expand(
            batch, -1, -1, num_queries, 1)
        probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
    probs = probs.reshape(batch, num_kv_heads, group * num_queries, -1)
    return (probs @ v.float()).view(batch, num_heads, num_queries, head_dim).to(q.dtype)
