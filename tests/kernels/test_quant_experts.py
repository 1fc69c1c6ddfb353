"""Routed experts in GGUF blocks (``moe.LinearExperts``): each expert's layers on the backend's
quantized linear kernel, against ``reference.fused_moe_ref`` over gguf's own dequantization of
the blocks (float64), the routing included.

- CPU (``QuantLinear``): x and each expert's hidden row are quantized to int8 per block (32
  values, 256 for the K formats) before their integer dot products (``test_cpu_quant.py``
  bounds one such matmul). So the tight oracle is that arithmetic itself in float64
  (``_int8_oracle``: ``gguf_blocks.quantize_x`` of each matmul's input): in fp32 the kernels
  are within fp32's roundings of it, 1e-5 per token in norm (about 3e-7 is what they give; a
  value a hair from a half-step could round the other way, one step of its block's scale,
  and these seeds have none that moves a token that far). Against the float oracle the int8
  inputs cost about 2 % per token on these random experts (each value moves by up to half a
  step, max |block| / 254, and heavy-tailed hidden rows have large maxima), bf16's roundings of
  x, the hidden rows and the result a little more: both are held to 5 %, and a mistake in the
  routing is far outside it (``test_a_wrong_expert_shows``).
- Triton (interpreted on the CPU): the weights are dequantized exactly and multiplied in fp32
  (``test_triton_quant.py``), so the experts are held to the fp32 tolerance of two matmuls.

A decode row reads its routed experts' blocks and no others: only their layers are called.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf_blocks as gb
from actorlm.kernels import Experts, moe, reference, select_backend
from actorlm.kernels.reference import act_and_mul_ref
from actorlm.kernels.cpu import native

HIDDEN, INTERMEDIATE, NUM_EXPERTS = 64, 32, 6
FORMATS = [("Q8_0",) * 3, ("Q4_0",) * 3, ("Q4_1",) * 3, ("Q5_0",) * 3,
           ("Q4_0", "Q8_0", "Q5_0")]  # (gate, up, down): a file may mix them
K_FORMATS = [("Q4_K", "Q4_K", "Q6_K")]  # 256-value blocks: hidden and intermediate 256
MAX_RELATIVE_ERROR = 5e-2  # per token, in norm, against the float oracle (the CPU's int8 x)
MAX_INT8_ORACLE_ERROR = 1e-5  # per token, in norm, fp32 against the int8 arithmetic's oracle


def _quantized_experts(formats, hidden, intermediate, num_experts=NUM_EXPERTS, seed=0):
    """(Experts in blocks, their dequantized gate_up [E, 2I, H] and down [E, H, I], float64)."""
    rng = np.random.default_rng(seed)
    gate_type, up_type, down_type = formats
    gate_up, down, gate_up_values, down_values = [], [], [], []
    for _ in range(num_experts):
        gate, up = (gb.random_blocks(t, intermediate, hidden, rng) for t in (gate_type, up_type))
        rows = gb.random_blocks(down_type, hidden, intermediate, rng)
        gate_up.append((gb.quantized_weight(gate_type, gate, hidden),
                        gb.quantized_weight(up_type, up, hidden)))
        down.append(gb.quantized_weight(down_type, rows, intermediate))
        gate_up_values.append(torch.cat([gb.dequantized(gate_type, gate),
                                         gb.dequantized(up_type, up)]))
        down_values.append(gb.dequantized(down_type, rows))
    # scaled so that the hidden rows stay O(1): the random weights' magnitudes vary by format
    scale = 1 / torch.stack(gate_up_values).abs().mean() / hidden ** 0.5
    experts = Experts(tuple(gate_up), tuple(down))
    return experts, torch.stack(gate_up_values), torch.stack(down_values), float(scale)


def _inputs(num_tokens, hidden, scale, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen) * scale
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen)
    return x, logits


def _int8_oracle(x, logits, gate_up, down, top_k, renormalize, values):
    """The CPU kernels' arithmetic in float64: each matmul's input quantized per block of
    ``values`` as they quantize it, the routing ``moe.route``'s."""
    weights, ids = moe.route(logits, top_k, renormalize)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        x_q = gb.quantize_x(x[t:t + 1].double(), values)[0]
        for weight, expert in zip(weights[t].tolist(), ids[t].tolist()):
            hidden = act_and_mul_ref(x_q @ gate_up[expert].T, "silu")
            out[t] += weight * (gb.quantize_x(hidden, values)[0] @ down[expert].T)[0]
    return out


def _relative_errors(ours, expected):
    return ((ours.double() - expected.double()).norm(dim=-1) /
            expected.double().norm(dim=-1))


@pytest.mark.skipif(native.library() is None, reason="needs the C++ CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (5, 2), (37, 3)])
@pytest.mark.parametrize("formats", FORMATS + K_FORMATS, ids="-".join)
def test_cpu_experts_in_blocks_match_the_dequantized_oracle(formats, num_tokens, top_k, dtype):
    size = 256 if formats in K_FORMATS else None
    hidden, intermediate = size or HIDDEN, size or INTERMEDIATE
    experts, gate_up, down, scale = _quantized_experts(formats, hidden, intermediate)
    backend = select_backend("cpu")
    prepared = backend.prepare_experts(experts)
    assert isinstance(prepared, moe.LinearExperts)
    assert type(prepared.gate_up[0]).__name__ == "QuantLinear"
    x, logits = _inputs(num_tokens, hidden, scale)
    x = x.to(dtype)
    ours = backend.fused_moe(x, logits, prepared, top_k, renormalize=True)
    expected = reference.fused_moe_ref(x.double(), logits, gate_up, down, top_k, True)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert _relative_errors(ours, expected).max() <= MAX_RELATIVE_ERROR
    if dtype == torch.float32:
        int8 = _int8_oracle(x, logits, gate_up, down, top_k, True, 256 if size else 32)
        assert _relative_errors(ours, int8).max() <= MAX_INT8_ORACLE_ERROR


@pytest.mark.skipif(native.library() is None, reason="needs the C++ CPU kernels")
def test_a_wrong_expert_shows():
    """The bound tells a wrong routing: the same tokens with their experts' ids shifted by one
    are far outside it."""
    experts, gate_up, down, scale = _quantized_experts(FORMATS[0], HIDDEN, INTERMEDIATE)
    backend = select_backend("cpu")
    x, logits = _inputs(5, HIDDEN, scale)
    ours = backend.fused_moe(x, logits.roll(1, dims=-1), backend.prepare_experts(experts), 2,
                             True)
    expected = reference.fused_moe_ref(x.double(), logits, gate_up, down, 2, True)
    assert _relative_errors(ours, expected).min() > 10 * MAX_RELATIVE_ERROR


@pytest.mark.skipif(native.library() is None, reason="needs the C++ CPU kernels")
def test_a_decode_row_calls_only_its_routed_experts_layers():
    experts, _, _, scale = _quantized_experts(FORMATS[0], HIDDEN, INTERMEDIATE)
    backend = select_backend("cpu")
    prepared = backend.prepare_experts(experts)
    called = []

    def counted(expert, layer):
        def run(rows):
            called.append(expert)
            return layer(rows)
        return run

    prepared.gate_up = [counted(e, layer) for e, layer in enumerate(prepared.gate_up)]
    prepared.down = [counted(e, layer) for e, layer in enumerate(prepared.down)]
    x, logits = _inputs(1, HIDDEN, scale)
    backend.fused_moe(x, logits, prepared, 2, True)
    routed = sorted(logits[0].topk(2).indices.tolist())
    assert sorted(called) == sorted(routed * 2)  # each routed expert's gate/up and down, once


def test_another_ranks_experts_add_nothing():
    """Expert parallelism: a rank holding experts 3..5 of the router's 6 adds only theirs."""
    experts, gate_up, down, scale = _quantized_experts(FORMATS[0], HIDDEN, INTERMEDIATE)
    backend = select_backend("cpu")
    held = backend.prepare_experts(experts._replace(gate_up=experts.gate_up[3:],
                                                    down=experts.down[3:], first_expert=3))
    x, logits = _inputs(7, HIDDEN, scale)
    ours = backend.fused_moe(x, logits, held, 2, False)
    zeroed_gate_up, zeroed_down = gate_up.clone(), down.clone()
    zeroed_gate_up[:3], zeroed_down[:3] = 0, 0
    expected = reference.fused_moe_ref(x.double(), logits, zeroed_gate_up, zeroed_down, 2, False)
    touched = expected.norm(dim=-1) > 0  # tokens with a slot on a held expert
    assert touched.any() and not touched.all()
    assert torch.equal(ours[~touched], torch.zeros_like(ours[~touched]))
    assert _relative_errors(ours[touched], expected[touched]).max() <= MAX_RELATIVE_ERROR


@pytest.mark.parametrize("formats", [FORMATS[4]], ids="-".join)
def test_triton_experts_in_blocks_match_the_dequantized_oracle(formats):
    """Each expert's rows through the Triton quantized GEMM (interpreted here): exact weights,
    fp32 products and sums, held to fp32's tolerance over a few dozen terms."""
    experts, gate_up, down, scale = _quantized_experts(formats, HIDDEN, INTERMEDIATE,
                                                       num_experts=4)
    from actorlm.kernels.triton.backend import TritonBackend

    backend = TritonBackend(torch.empty(0).device)
    prepared = backend.prepare_experts(experts)
    assert isinstance(prepared, moe.LinearExperts)
    x, logits = _inputs(3, HIDDEN, scale)
    logits = logits[:, :4]
    ours = backend.fused_moe(x, logits, prepared, 2, False)
    expected = reference.fused_moe_ref(x.double(), logits, gate_up, down, 2, False)
    # two fp32 matmuls of <= 64 terms and the fp32 weighting: a few thousand ulps at most
    torch.testing.assert_close(ours.double().cpu(), expected, rtol=1e-4, atol=1e-5)
