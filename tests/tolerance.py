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
  states between ops, HF's order) adds ``u * |x|`` more, carried through what follows.

Each test states which of these its kernel performs; the helpers below turn that into a bound
per element.
"""

from __future__ import annotations

import math

import torch

LAMBDA = 8.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of rounding to nearest in ``dtype``."""
    return torch.finfo(dtype).eps / 2


def sum_error(num_terms: int, abs_sum: torch.Tensor | float,
              accumulate: torch.dtype = torch.float32) -> torch.Tensor | float:
    """The bound on the error of a sum of ``num_terms`` terms whose magnitudes sum to
    ``abs_sum``, accumulated in ``accumulate``."""
    return LAMBDA * math.sqrt(num_terms) * unit_roundoff(accumulate) * abs_sum


def rounding_error(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bound on rounding ``value`` once to ``dtype``."""
    return unit_roundoff(dtype) * value.abs().double()


def matmul_error(x: torch.Tensor, weight: torch.Tensor, expected: torch.Tensor,
                 accumulate: torch.dtype = torch.float32,
                 output: torch.dtype | None = None) -> torch.Tensor:
    """Per element of ``x [M, K] @ weight [N, K].T``: the accumulation's bound (from each
    row-column pair's sum of |products|) plus the output's rounding. ``output`` defaults to
    the accumulation dtype (then the rounding is already in the sum's bound)."""
    abs_sum = x.double().abs() @ weight.double().abs().T  # [M, N]
    bound = sum_error(x.shape[-1], abs_sum, accumulate)
    if output is not None and output != accumulate:
        bound = bound + rounding_error(expected, output)
    return bound


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
