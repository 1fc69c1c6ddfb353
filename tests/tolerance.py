"""Tolerances derived from what a kernel computes, never from the machine a test was written on.

A kernel is held to the float64 oracle (``actorlm/kernels/reference.py``), so what separates
them is the kernel's own rounding, which follows from its arithmetic:

- A sum of n terms accumulated in a dtype of unit roundoff u, in whatever order the compiler
  (``-march=native``: per CPU) or the tiling chooses, is off by at most about
  ``lambda * sqrt(n) * u * sum|terms|``. This is the probabilistic bound of Higham and Mary
  ("A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 2019): it
  holds with probability at least ``1 - 2 n exp(-lambda^2 / 2)`` per sum for independent
  rounding errors; ``LAMBDA = 8`` makes that 1 - 2e-11 n. (The worst case, ``n u sum|terms|``,
  is reached only by adversarial inputs and would let real bugs through at large n.)
- Rounding a result once to an output dtype of unit roundoff u_out moves it by at most
  ``u_out * |result|``; each intermediate rounding of a value x to a narrower dtype (bf16 hidden
  states between ops, HF's order) adds ``u * |x|`` more, carried through what follows. The
  oracle returns its result rounded to the kernel's dtype too, so comparing the two counts that
  rounding twice (once each side: two values a hair apart may round to neighbouring grid
  points, one ulp = ``2 u_out |result|`` apart); the helpers add the oracle's rounding whenever
  ``expected`` is not float64.

Each test states which of these its kernel performs; the helpers below turn that into a bound
per element.
"""

from __future__ import annotations

import torch

from actorlm.kernels.backend import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

LAMBDA = 8.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of rounding to nearest in ``dtype``."""
    return torch.finfo(dtype).eps / 2


def sum_error(num_terms: int | torch.Tensor, abs_sum: torch.Tensor | float,
              accumulate: torch.dtype = torch.float32) -> torch.Tensor | float:
    """The bound on the error of a sum of ``num_terms`` terms whose magnitudes sum to
    ``abs_sum``, accumulated in ``accumulate`` (``num_terms`` may be a tensor of counts, one per
    sum, broadcast against ``abs_sum``)."""
    return LAMBDA * num_terms**0.5 * unit_roundoff(accumulate) * abs_sum


def rounding_error(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bound on rounding ``value`` once to ``dtype`` (half a subnormal step at the least,
    where ``|value|`` is below the normal range)."""
    return torch.clamp(unit_roundoff(dtype) * value.abs().double(), min=_subnormal_error(dtype))


def _subnormal_error(dtype: torch.dtype) -> float:
    """The largest error of rounding to ``dtype`` among its subnormals: half their spacing."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2


def _oracle_rounding(expected: torch.Tensor) -> torch.Tensor | float:
    """The oracle's own rounding of ``expected`` to the dtype it was returned in (none in
    float64, where the oracle computes)."""
    return 0.0 if expected.dtype == torch.float64 else rounding_error(expected, expected.dtype)


def matmul_error(x: torch.Tensor, weight: torch.Tensor, expected: torch.Tensor,
                 accumulate: torch.dtype = torch.float32,
                 output: torch.dtype | None = None) -> torch.Tensor:
    """Per element of ``x [..., K] @ weight [N, K].T``: the accumulation's bound (from each
    row-column pair's sum of |products|) plus the output's rounding, and the oracle's where
    ``expected`` is not float64. ``output`` defaults to the accumulation dtype (then the
    kernel's rounding is already in the sum's bound)."""
    abs_sum = x.double().abs() @ weight.double().abs().T  # [..., N]
    bound = sum_error(x.shape[-1], abs_sum, accumulate) + _oracle_rounding(expected)
    if output is not None and output != accumulate:
        bound = bound + rounding_error(expected, output)
    return bound


def linear_error(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 expected: torch.Tensor, accumulate: torch.dtype = torch.float32,
                 output: torch.dtype | None = None) -> torch.Tensor:
    """``matmul_error`` of ``x @ weight.T + bias``: the bias is one more term of each sum
    (a column of ones in x against the bias as a column of the weight)."""
    if bias is None:
        return matmul_error(x, weight, expected, accumulate, output)
    ones = torch.ones(*x.shape[:-1], 1, dtype=torch.float64, device=x.device)
    return matmul_error(torch.cat((x.double(), ones), -1),
                        torch.cat((weight.double(), bias.double()[:, None]), -1),
                        expected, accumulate, output)


def assert_within(actual: torch.Tensor, expected: torch.Tensor,
                  bound: torch.Tensor | float, what: str = "") -> None:
    """Every element of ``actual`` within ``bound`` of ``expected``; the message names the
    worst element and how far past its bound it is."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    error = (actual.double() - expected.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64, device=error.device).expand_as(error)
    if error.numel() == 0 or bool((error <= bound).all()):
        return
    excess = error - bound
    worst = int(excess.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), error.shape))
    raise AssertionError(
        f"{what}: {int((error > bound).sum())} of {error.numel()} elements past their bound; "
        f"worst at {index}: got {actual[index].item()!r}, expected {expected[index].item()!r}, "
        f"error {error[index].item():.3e} > bound {bound[index].item():.3e}")


def attention_error(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                    visible: torch.Tensor, expected: torch.Tensor,
                    accumulate: torch.dtype = torch.float32, probs: torch.dtype | None = None,
                    output: torch.dtype | None = None) -> torch.Tensor:
    """Per element of one request's attention: query [L, H, D] over key, value [S, H, D] (the KV
    heads repeated for each of their query heads), query row l seeing the positions where
    ``visible`` [L, S] holds; ``expected`` [L, H, D]. A kernel whose scores, softmax and sums
    run in ``accumulate`` (online or not, split over spans and merged or not) and which rounds
    the probabilities to ``probs`` before P @ V (None: it keeps them in ``accumulate``), then
    its output to ``output`` (None: ``accumulate``).

    Per query row and head, over its n visible positions j: s_j = scale * q . k_j, m = max s,
    p = softmax(s), o = sum_j p_j v_j, and A_j = |scale| * sum_d |q_d k_jd|; u is
    ``accumulate``'s unit roundoff.

    1. Scores. s_j is a D-term dot product, scaled (before, as q * scale, or after, with the
       scale and log2(e) rounded once more): at most D + 3 roundings per term, so
       |ds_j| <= sum_error(D + 3, A_j). The exponent s_j - m' (m' the running max, s_j <= m'
       <= m) is rounded once more, u * (m - s_j); exp / exp2 are good to 2 ulps, 4u. Rescaling
       by exp(m_old - m_new) multiplies the running sum of P @ V and the normaliser by the same
       rounded factor, so that factor's error cancels (its multiplications are counted in 3).
       With delta_j the sum of these, first order in the softmax's Jacobian,
       do = sum_j p_j (ds_j - sum_i p_i ds_i) v_j = sum_j p_j ds_j (v_j - o), so
       |do_d| <= sum_j p_j delta_j |v_jd - o_d|.
    2. P rounded to ``probs`` (bf16/fp16 for the tensor-core dot) moves each p_j by e_j =
       max(u_p p_j, half a subnormal step) at most: it is rounded unnormalised, as
       exp(s_j - m') <= 1, and the rescales and the division by a normaliser >= 1 carry its
       relative error unchanged and shrink an absolute one. The rounded P enters P @ V alone
       (Triton) or the normaliser too (SDPA may sum it): |do_d| <= sum_j e_j (|v_jd| + |o_d|).
       Summed in the worst case, not the probabilistic way: 8 bits of p leave its rounding
       errors far from independent.
    3. P @ V: each term passes its product, at most n - 1 additions, at most one rescale per
       later block and the merge of spans (a weight, an addition): at most 2n + 2 roundings,
       |do_d| <= sum_error(2n + 2, sum_j p_j |v_jd|).
    4. The normaliser: a sum of n positive terms with the same roundings, then a division (or a
       reciprocal and a product): |do_d| <= |o_d| (sum_error(2n + 2, 1) + 2u).
    5. The output's rounding to ``output``, and the oracle's where ``expected`` is not float64.

    Second-order terms (u^2, delta^2) are left out: LAMBDA's margin covers them many times.
    Returns the bound in float64, [L, H, D].
    """
    q, k, v = query.double(), key.double(), value.double()
    u = unit_roundoff(accumulate)
    scores = torch.einsum("lhd,shd->hls", q, k) * scale  # [H, L, S]
    abs_scores = torch.einsum("lhd,shd->hls", q.abs(), k.abs()) * abs(scale)
    scores = scores.masked_fill(~visible, float("-inf"))
    p = scores.softmax(-1)  # [H, L, S]
    o = torch.einsum("hls,shd->hld", p, v)  # [H, L, D]
    num_visible = visible.sum(-1).double()[None, :, None]  # [1, L, 1]: n of each row
    head_dim = q.shape[-1]
    below_max = (scores.amax(-1, keepdim=True) - scores).nan_to_num(0.0, posinf=0.0)
    delta = sum_error(head_dim + 3, abs_scores, accumulate) + u * below_max + 4 * u
    weight = torch.where(visible, p * delta, 0.0)  # [H, L, S]
    v_hsd = v.transpose(0, 1)  # [H, S, D]
    bound = (weight[..., None] * (v_hsd[:, None] - o[:, :, None]).abs()).sum(2)  # 1.
    if probs is not None and probs != accumulate:  # 2.
        e = torch.clamp(unit_roundoff(probs) * p, min=_subnormal_error(probs))
        e = torch.where(visible, e, 0.0)  # [H, L, S]
        bound = bound + e @ v_hsd.abs() + e.sum(-1, keepdim=True) * o.abs()
    num_roundings = 2 * num_visible + 2
    bound = bound + sum_error(num_roundings, p @ v_hsd.abs(), accumulate)  # 3.
    bound = bound + o.abs() * (sum_error(num_roundings, 1.0, accumulate) + 2 * u)  # 4.
    bound = bound.transpose(0, 1) + _oracle_rounding(expected)  # [L, H, D]; 5.
    if output is not None and output != accumulate:
        bound = bound + rounding_error(o.transpose(0, 1), output)
    return bound


def experts_error(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, top_k: int, renormalize: bool, expected: torch.Tensor,
                  accumulate: torch.dtype = torch.float32, gate_up_bias=None, down_bias=None,
                  swiglu_oai: bool = False) -> torch.Tensor:
    """Per element of a mixture of experts' output [T, H] (``reference.fused_moe_ref``'s
    arguments; SiLU, or GPT-OSS's clamped SwiGLU with ``swiglu_oai``, see below; the biases,
    where given, one more term of their sums), for a kernel that picks the experts the oracle
    picks, sums each matmul in
    ``accumulate`` and rounds every intermediate to x's dtype (u_x) as transformers' ops do.
    With g, up = gate_up[e] @ x, h = silu(g) * up, y = down[e] @ h and w the routing weights:

    1. g and up: ``sum_error(H, |gate_up[e]| @ |x|)``, plus their rounding to x's dtype (dg).
    2. h: silu' is at most 1.1, so dh <= 1.1 |up| dg + |silu(g)| dup, plus the activation's
       evaluation (4 u) and the roundings of silu(g) and of the product (2 u_x), times |h|.
    3. y: ``sum_error(I, |down[e]| @ |h|) + |down[e]| @ dh``, plus its rounding to x's dtype.
    4. w: a softmax over E terms and a renormalisation in fp32, each weight off by at most
       ``(sum_error(E, 1) + 6 u) w``; the product w y is rounded to x's dtype once.
    5. The top_k products summed in x's dtype: k - 1 roundings, each of at most
       ``u_x sum_j |w_j y_j|`` (the worst case: k is small). Then the oracle's rounding.

    The clamped SwiGLU, h = (up' + 1) g' sigmoid(z) of g' = min(g, 7), up' = clamp(up, -7, 7),
    z = 1.702 g': the clamps' slopes are at most 1, and g sigmoid(1.702 g) = silu(z) / 1.702
    has silu's slope, at most 1.1, so dh <= 1.1 |up' + 1| dg + |g' sigmoid(z)| dup; its
    evaluation in fp32 (12 + 3 |z|) u (sigmoid's exp of a rounded z), and in x's dtype op by
    op as transformers computes it (the torch path, the C++ kernel) five roundings, z's moving
    sigmoid by |z| (1 - sigmoid(z)) of one: (5 + |z| sigmoid(-z)) u_x, times |h|.
    """
    u, u_x = unit_roundoff(accumulate), unit_roundoff(x.dtype)
    narrow_x = x.dtype != accumulate
    x64 = x.double()
    probs = router_logits.double().softmax(-1)  # [T, E]
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    num_experts, num_features = gate_up.shape[0], gate_up.shape[1] // 2
    bound = torch.zeros_like(x64)
    abs_total = torch.zeros_like(x64)
    for j in range(top_k):  # each token's j-th expert, all tokens at once
        w = weights[:, j, None]  # [T, 1]
        gu, dn = gate_up.double()[ids[:, j]], down.double()[ids[:, j]]  # [T, 2I, H], [T, H, I]
        g_up = torch.einsum("tnh,th->tn", gu, x64)
        abs_g_up = torch.einsum("tnh,th->tn", gu.abs(), x64.abs())
        if gate_up_bias is not None:
            g_up = g_up + gate_up_bias.double()[ids[:, j]]
            abs_g_up = abs_g_up + gate_up_bias.double()[ids[:, j]].abs()
        d_gu = sum_error(x.shape[-1] + (gate_up_bias is not None), abs_g_up, accumulate)
        if narrow_x:
            d_gu = d_gu + u_x * g_up.abs()
        (g, up), (dg, dup) = g_up.chunk(2, -1), d_gu.chunk(2, -1)  # 1.
        if swiglu_oai:
            g, up = g.clamp(max=SWIGLU_OAI_LIMIT), up.clamp(-SWIGLU_OAI_LIMIT,
                                                            SWIGLU_OAI_LIMIT) + 1
            z = SWIGLU_OAI_ALPHA * g
            act, evaluation = g * torch.sigmoid(z), \
                (12 + 3 * z.abs()) * u + (5 + z.abs() * torch.sigmoid(-z)) * u_x
        else:
            act, evaluation = g * torch.sigmoid(g), 4 * u + 2 * u_x
        h = act * up
        dh = 1.1 * up.abs() * dg + act.abs() * dup + evaluation * h.abs()  # 2.
        y = torch.einsum("thi,ti->th", dn, h)
        abs_y = torch.einsum("thi,ti->th", dn.abs(), h.abs())
        if down_bias is not None:
            y = y + down_bias.double()[ids[:, j]]
            abs_y = abs_y + down_bias.double()[ids[:, j]].abs()
        dy = sum_error(num_features + (down_bias is not None), abs_y, accumulate) + \
            torch.einsum("thi,ti->th", dn.abs(), dh)  # 3.
        if narrow_x:
            dy = dy + u_x * y.abs()
        dw = (sum_error(num_experts, 1.0, accumulate) + 6 * u) * w
        product = (w * y).abs()
        bound = bound + w * dy + dw * y.abs() + u_x * product  # 4.
        abs_total = abs_total + product
    bound = bound + (top_k - 1) * u_x * abs_total  # 5.
    return bound + _oracle_rounding(expected)
