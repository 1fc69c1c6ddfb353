"""The oracle: every kernel's semantics in plain torch, written for clarity, not speed.

Tests hold both wings to these functions (the CPU wing's C++ and torch paths, the Triton
kernels under ``TRITON_INTERPRET=1``); the engine never calls them. Each computes in float64
where the kernel sums (norms, attention, linear layers) and rounds once to the kernel's output
dtype, so a kernel's error against it is its own rounding alone: tests derive their tolerance
from that (the length and magnitude of the sums, the dtype), not from another implementation.

The paged-cache layout they read: ``k_cache``, ``v_cache`` [num_blocks, block_size, Hkv, D];
request b's context of ``seq_lens[b]`` tokens sits in the blocks ``block_tables[b]``; its
``q_len`` query rows are the last ``q_len`` positions of that context.
"""

from __future__ import annotations

import math

import torch

from actorlm.kernels.backend import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, check_activation
from actorlm.sampling_params import GREEDY_TEMPERATURE


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 unit_offset: bool = False) -> torch.Tensor:
    """x [T, H] / sqrt(mean(x^2) + eps), scaled by ``weight`` [H] (``1 + weight`` with
    ``unit_offset``), in x's dtype."""
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    scale = weight.double() + 1.0 if unit_offset else weight.double()
    return (normed * scale).to(x.dtype)


def add_rms_norm_ref(x, residual, weight, eps, unit_offset=False):
    """(rms_norm_ref(x + residual), x + residual): the residual stream is held in x's dtype."""
    stream = (x.double() + residual.double()).to(x.dtype)
    return rms_norm_ref(stream, weight, eps, unit_offset), stream


def act_and_mul_ref(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """gate_up [T, 2I] (each row [gate | up]) -> act(gate) * up [T, I]; ``activation`` is
    ``silu``, ``gelu_tanh`` (GeLU's tanh approximation), ``relu``, ``relu2`` (relu squared) or
    ``gelu`` (exact, by erf); ``swiglu_oai``: GPT-OSS's, (clamp(up, -7, 7) + 1) * g *
    sigmoid(1.702 g) of g = min(gate, 7)."""
    check_activation(activation)
    gate, up = gate_up.double().chunk(2, dim=-1)
    if activation == "swiglu_oai":
        gate, up = gate.clamp(max=SWIGLU_OAI_LIMIT), up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
        act, up = gate * torch.sigmoid(SWIGLU_OAI_ALPHA * gate), up + 1.0
    elif activation == "silu":
        act = gate * torch.sigmoid(gate)
    elif activation == "relu":
        act = gate.clamp(min=0)
    elif activation == "relu2":
        act = gate.clamp(min=0).square()
    elif activation == "gelu":
        act = 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0)))
    else:
        act = 0.5 * gate * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) *
                                             (gate + 0.044715 * gate.pow(3))))
    return (act * up).to(gate_up.dtype)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x [M, K] @ weight [N, K].T + bias [N], in x's dtype."""
    y = x.double() @ weight.double().T
    return (y if bias is None else y + bias.double()).to(x.dtype)


def fused_moe_ref(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, top_k: int, renormalize: bool,
                  activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """A mixture-of-experts MLP, token by token: x [T, H] goes to the ``top_k`` experts of
    highest router logit [T, E] (highest softmax probability), each weighted by its
    probability (over the chosen ones' sum, with ``renormalize``); expert e computes
    ``down[e] @ act_and_mul(gate_up[e] @ x + gate_up_bias[e]) + down_bias[e]`` (gate_up
    [E, 2I, H], down [E, H, I], the biases [E, 2I] and [E, H] or None). Returns [T, H] in x's
    dtype."""
    out = torch.empty_like(x)
    probs = router_logits.double().softmax(-1)  # [T, E]
    for t in range(x.shape[0]):
        weights, ids = probs[t].topk(top_k)
        if renormalize:
            weights = weights / weights.sum()
        total = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
        for weight, e in zip(weights.tolist(), ids.tolist()):
            projected = gate_up[e].double() @ x[t].double()
            if gate_up_bias is not None:
                projected = projected + gate_up_bias[e].double()
            hidden = act_and_mul_ref(projected[None], activation)[0].double()
            out_e = down[e].double() @ hidden
            total += weight * (out_e if down_bias is None else out_e + down_bias[e].double())
        out[t] = total.to(x.dtype)
    return out


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
             scaling: float = 1.0) -> torch.Tensor:
    """x [T, H, D] rotated by HF's (neox) RoPE at ``positions`` [T]: the two halves of each head
    are the real and imaginary parts, angle ``position * inv_freq`` [D / 2]."""
    angle = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, D/2]
    cos, sin = (angle.cos() * scaling)[:, None], (angle.sin() * scaling)[:, None]
    first, second = x.double().chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), -1).to(x.dtype)


def write_kv_ref(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatter new K/V into the paged cache, in place; a negative slot skips its token.

    key, value: [T, Hkv, D]; slot_mapping: [T], slot = block_id * block_size + offset. An FP8
    cache (``--kv-cache-dtype``) stores each value rounded to the nearest, ties to even, and
    beyond its largest finite value that value (vLLM's saturating conversion, scale one).
    """
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_flat[slot] = _stored(key[token], k_cache.dtype)
            v_flat[slot] = _stored(value[token], v_cache.dtype)


def _stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        largest = torch.finfo(dtype).max
        x = torch.where(x.double().abs() > largest, x.double().sign() * largest, x.double())
    return x.to(dtype)


def paged_attention_ref(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                        scale: float, *, max_query_len: int | None = None,
                        max_seq_len: int | None = None, window: int | None = None,
                        softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each request's query rows over its paged context, request by request.

    query: [T, Hq, D] (Hq a multiple of Hkv: query head h reads KV head h // (Hq / Hkv));
    block_tables: [B, max_blocks]; query_start_loc: [B + 1]; seq_lens: [B]. The query at
    position p sees positions 0..p (the last ``window`` of them, with a window: those past
    p - window). With a ``softcap``, the scaled scores become ``softcap * tanh(s / softcap)``
    before the mask and the softmax (Gemma 2). ``sinks`` [Hq]: each head's softmax also counts
    exp(sinks[h]) in its denominator, a score no value goes with (GPT-OSS). Returns [T, Hq, D]
    in query's dtype.
    ``max_query_len`` and ``max_seq_len`` are the launchers' host-side hints, unused here.
    """
    group = query.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        positions = torch.arange(seq_len, device=query.device)
        k, v = (c.double() for c in request_context(k_cache, v_cache, block_tables[b], seq_len,
                                                    group))  # [S, Hq, D]
        scores = torch.einsum("lhd,shd->hls", query[start:end].double(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = positions[seq_len - (end - start):]  # [L]
        visible = positions[None, :] <= q_pos[:, None]  # [L, S]
        if window is not None:
            visible &= positions[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more column per head, dropped after the softmax
            sink = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hls,shd->lhd", probs, v).to(query.dtype)
    return out


def bidirectional_attention_ref(q, k, v, query_start_loc, scale: float,
                                score_bias=None, window: int | None = None) -> torch.Tensor:
    """An encoder's attention, written out: q [T, Hq, D], k/v [T, Hkv, D]; each request's rows
    (``query_start_loc``) see all of its rows (with ``window``, those at most ``window``
    positions away), ``score_bias(n)`` [Hq, n, n] added to the scaled scores of a request of
    n rows -> [T, Hq, D] in q's dtype."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for begin, end in zip(query_start_loc, query_start_loc[1:]):
        qs, ks, vs = (t[begin:end].double() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if score_bias is not None:
            scores = scores + score_bias(end - begin).double()
        if window is not None:
            rows = torch.arange(end - begin)
            far = (rows[:, None] - rows[None, :]).abs() > window
            scores = scores.masked_fill(far, float("-inf"))
        out[begin:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
    return out.to(q.dtype)


def request_context(k_cache, v_cache, block_table, seq_len: int, group: int = 1):
    """(k, v) [seq_len, Hkv * group, D]: a request's context read through its block table,
    each KV head repeated for the ``group`` query heads that read it."""
    block_size = k_cache.shape[1]
    positions = torch.arange(seq_len, device=k_cache.device)
    blocks = block_table.long()[positions // block_size]
    k, v = k_cache[blocks, positions % block_size], v_cache[blocks, positions % block_size]
    return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


def sampling_probs_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[B, V] float64: the distribution each row's token is drawn from.

    Rows with temperature < ``GREEDY_TEMPERATURE`` put all mass on the argmax (its lowest index
    on ties). Others: softmax(logits / T); keep the ``top_k`` most likely (<= 0 or >= V: all);
    of those, renormalised, the smallest head in descending order whose mass reaches ``top_p``;
    then drop what is below ``min_p`` times the most likely token's probability; renormalise.
    Ties in the descending order go to the lower token id.
    """
    num_rows, vocab_size = logits.shape
    out = torch.zeros(num_rows, vocab_size, dtype=torch.float64, device=logits.device)
    for b in range(num_rows):
        row = logits[b].double()
        if float(temperature[b]) < GREEDY_TEMPERATURE:
            out[b, int(row.argmax())] = 1.0
            continue
        probs = torch.softmax(row / float(temperature[b]), dim=-1)
        order = torch.sort(probs, descending=True, stable=True).indices
        keep = torch.ones(vocab_size, dtype=torch.bool, device=logits.device)
        k = int(top_k[b])
        if 0 < k < vocab_size:
            keep[order[k:]] = False
        if float(top_p[b]) < 1.0:
            head = (probs * keep / (probs * keep).sum())[order]
            keep[order[(head.cumsum(0) - head) >= float(top_p[b])]] = False
        keep &= probs >= float(min_p[b]) * probs.max()
        keep[order[0]] = True  # the most likely token always survives
        kept = probs * keep
        out[b] = kept / kept.sum()
    return out
