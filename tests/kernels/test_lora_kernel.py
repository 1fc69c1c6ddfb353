"""The LoRA deltas of a batch that mixes adapters and the base model: each token gets its own
slot's delta, computed token by token in float64 as the oracle, whether its slot's rows are
one run or scattered, and a token without an adapter gets none."""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels.lora import LoRAMapping, add_lora


def per_token(y, x, a, b, slots):
    """The oracle: token by token, in float64."""
    out = y.double().clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[t] += b[slot].double() @ (a[slot].double() @ x[t].double())
    return out


@pytest.mark.parametrize("slots", [
    [0, 0, 0, 0],  # one adapter: one run, a view
    [-1, 2, 2, -1, 1, 1, 1, 2],  # two requests of adapter 2 apart: scattered rows
    [-1, -1, -1],  # the base model alone: nothing added
    [3, -1, 0, 3, 3],
], ids=["one-run", "mixed", "base-only", "scattered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_token_gets_its_own_slots_delta(slots, dtype):
    torch.manual_seed(0)
    num_slots, rank, d_in, d_out = 4, 8, 24, 40
    a = torch.randn(num_slots, rank, d_in, dtype=dtype)
    b = torch.randn(num_slots, d_out, rank, dtype=dtype)
    x = torch.randn(len(slots), d_in, dtype=dtype)
    y = torch.randn(len(slots), d_out, dtype=dtype)
    expected = per_token(y, x, a, b, slots)
    got = add_lora(y.clone(), x, a, b, LoRAMapping.build(slots, "cpu"))
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(got.double(), expected, rtol=tolerance, atol=tolerance * 8)
    base_rows = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])


def test_a_lone_run_of_rows_is_a_slice_and_scattered_rows_an_index():
    groups = dict(LoRAMapping.build([-1, 1, 1, 0, 1], "cpu").groups)
    assert groups[0] == slice(3, 4)
    assert torch.equal(groups[1], torch.tensor([1, 2, 4]))
    assert LoRAMapping.build([-1, -1], "cpu").groups == []
