"""The LoRA deltas of a batch that mixes adapters and the base model: each token gets its own
slot's delta, computed token by token in float64 as the oracle, whether its slot's rows are
one run or scattered, and a token without an adapter gets none; the torch path, the CPU kernel
(reading only the diagonal blocks of a merged layer's B) and the Triton kernels (on their CPU
interpreter) alike, each within the roundings of the torch path.

Tolerances: fp32 1e-4 relative to the float64 oracle, and to the torch path 1e-5 (only the
order of each matmul's fp32 sum differs); bf16 0.1 to the oracle (the shrink's result, the
delta and the sum are each rounded to 8 bits), and to the torch path two units in the last
place, most values equal."""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels.cpu import lora as cpu_lora
from actorlm.kernels.cpu import native
from actorlm.kernels.lora import LoRAMapping, LoRATable, add_lora

needs_cpu_kernels = pytest.mark.skipif(native.library() is None,
                                       reason="the C++ CPU kernels are not built here "
                                              "(no C++ compiler, or ACTORLM_CPU_KERNELS=0)")
IMPLEMENTATIONS = [pytest.param("torch", id="torch"),
                   *(pytest.param(isa, id=f"cpu-{isa}", marks=needs_cpu_kernels)
                     for isa in cpu_lora.ISAS),
                   pytest.param("triton", id="triton")]  # (its CPU interpreter, on the CPU)


@pytest.fixture
def implementation(request):
    """add_lora in torch, the Triton kernels, or the CPU kernel on one of its paths (skipped
    where this CPU lacks it), the kernel's own path restored after."""
    if request.param == "torch":
        yield add_lora
        return
    if request.param == "triton":
        from actorlm.kernels.triton.lora import add_lora as triton_add_lora

        yield triton_add_lora
        return
    default = cpu_lora.isa()
    if not cpu_lora.set_isa(request.param):
        pytest.skip(f"this CPU (or build) has no {request.param} path for the LoRA kernel")
    yield cpu_lora.add_lora
    cpu_lora.set_isa(default)
SLOTS = {
    "one-run": [0, 0, 0, 0],  # one adapter: one run, a view
    "mixed": [-1, 2, 2, -1, 1, 1, 1, 2],  # two requests of adapter 2 apart: scattered rows
    "base-only": [-1, -1, -1],  # the base model alone: nothing added
    "scattered": [3, -1, 0, 3, 3],
    "blocks": [1, 0, 1, 1, -1, 1, 1, 0, 1, 1, 1, 1, 2],  # 9 rows of slot 1: blocks of 4, 4, 1
    # ragged groups: 37 rows of slot 2 (three of Triton's 16-row blocks), 1 of slot 0, 6 of 3
    "ragged": [2] * 20 + [-1, 0] + [3, 2] * 6 + [2] * 11 + [-1],
}


def per_token(y, x, table, slots):
    """The oracle: token by token, in float64."""
    out = y.double().clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[t] += (table.a[slot].double() @ x[t].double()) @ table.b[slot].double()
    return out


def random_table(num_slots, in_features, out_parts, part_rank, dtype):
    """Slots of a merged layer: B block-diagonal by parts, as ``LoRAWeights`` lays it out."""
    rank, out = part_rank * len(out_parts), sum(out_parts)
    a = torch.randn(num_slots, rank, in_features, dtype=dtype)
    b = torch.zeros(num_slots, rank, out, dtype=dtype)
    first = 0
    for p, rows in enumerate(out_parts):
        b[:, p * part_rank:(p + 1) * part_rank, first:first + rows] = \
            torch.randn(num_slots, part_rank, rows, dtype=dtype)
        first += rows
    return LoRATable(a, b, tuple(out_parts))


@pytest.mark.parametrize("slots", SLOTS.values(), ids=SLOTS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("out_parts, part_rank", [((40,), 8), ((24, 8, 8), 3), ((70, 70), 5)],
                         ids=["one-part", "qkv-like", "gate-up-like"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, indirect=True)
def test_each_token_gets_its_own_slots_delta(implementation, out_parts, part_rank, dtype,
                                             slots):
    torch.manual_seed(0)
    table = random_table(4, 24, out_parts, part_rank, dtype)
    x = torch.randn(len(slots), 24, dtype=dtype)
    y = torch.randn(len(slots), sum(out_parts), dtype=dtype)
    expected = per_token(y, x, table, slots)
    got = implementation(y.clone(), x, table, LoRAMapping.build(slots, "cpu"))
    # bf16: the shrink's result, the delta and the sum are each rounded to 8 bits
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(got.double(), expected, rtol=tolerance, atol=tolerance * 8)
    base_rows = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])


# (in, out_parts, part_rank, slots): small; then layers large enough that the CPU kernel splits
# one call over its threads (one row, one block of rows, many blocks), the outputs' split
# falling inside a part, widths not a multiple of its vectors
SHAPES = {
    "small": (64, (48, 16, 16), 4, [0, 1, -1, 1, 0, 0, 1]),
    "qkv-one-row": (600, (330, 110, 110), 16, [1]),
    "qkv-one-block": (600, (330, 110, 110), 16, [-1, 1, 1, 1]),
    "down-one-row": (1600, (500,), 16, [2]),
    "gate-up-blocks": (600, (700, 700), 8, [0, 1, -1, 1, 0, 0, 1, 1, 1, 1]),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS[1:], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_kernels_round_where_torch_rounds(implementation, dtype, shape):
    """Their results are torch's but for the order of the fp32 sums: in bf16 (where the
    rounding of the shrink, the delta and the sum decide) within two units in the last place
    and mostly the same bits; in fp32 within the sums' rounding."""
    in_features, out_parts, part_rank, slots = shape
    torch.manual_seed(1)
    table = random_table(3, in_features, out_parts, part_rank, dtype)
    x = torch.randn(len(slots), in_features, dtype=dtype)
    y = torch.randn(len(slots), sum(out_parts), dtype=dtype)
    mapping = LoRAMapping.build(slots, "cpu")
    ours = implementation(y.clone(), x, table, mapping)
    theirs = add_lora(y.clone(), x, table, mapping)
    if dtype == torch.float32:
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max())
        return
    ulp = theirs.abs().float() * 2**-7
    assert ((ours.float() - theirs.float()).abs() <= 2 * ulp).all()
    assert (ours == theirs).float().mean() > 0.9


@needs_cpu_kernels
def test_the_cpu_kernel_leaves_long_prefills_and_strided_rows_to_torch(monkeypatch):
    """Beyond ``MAX_ROWS`` rows, or with rows it cannot walk, the torch path runs (and gives
    the same deltas)."""
    torch.manual_seed(2)
    table = random_table(1, 16, (8,), 4, torch.float32)
    calls = []
    monkeypatch.setattr(cpu_lora.lora, "add_lora", lambda *args: calls.append(1) or
                        add_lora(*args))
    x, y = torch.randn(6, 16), torch.randn(6, 8)
    mapping = LoRAMapping.build([0] * 6, "cpu")
    expected = per_token(y, x, table, [0] * 6)
    assert torch.allclose(cpu_lora.add_lora(y.clone(), x, table, mapping).double(), expected,
                          atol=1e-4)
    assert calls == []
    monkeypatch.setattr(cpu_lora, "MAX_ROWS", 4)
    assert torch.allclose(cpu_lora.add_lora(y.clone(), x, table, mapping).double(), expected,
                          atol=1e-4)
    assert calls == [1]


def test_a_lone_run_of_rows_is_a_slice_and_scattered_rows_an_index():
    mapping = LoRAMapping.build([-1, 1, 1, 0, 1], "cpu")
    groups = dict(mapping.groups)
    assert groups[0] == slice(3, 4)
    assert torch.equal(groups[1], torch.tensor([1, 2, 4]))
    assert mapping.token_slots.tolist() == [-1, 1, 1, 0, 1]
    assert mapping.token_slots.dtype == torch.int32
    assert LoRAMapping.build([-1, -1], "cpu") == LoRAMapping([], None)
