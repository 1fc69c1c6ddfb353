"""write_kv (Triton, interpreted on the CPU) against write_kv_ref: a copy, so results must be equal;
into FP8 caches a rounding, the same bits on both wings."""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels import portable
from actorlm.kernels.triton.write_kv import write_kv
from actorlm.kernels.reference import write_kv_ref
from paged_batches import dtype_id


@pytest.mark.parametrize(
    "dtype, head_dim, num_kv_heads, block_size",
    [
        (torch.float32, 64, 1, 16),
        (torch.float16, 80, 2, 32),
        (torch.bfloat16, 96, 3, 16),
        (torch.float32, 128, 8, 32),
        (torch.bfloat16, 128, 2, 32),
    ],
    ids=dtype_id,
)
def test_write_kv_matches_reference(dtype, head_dim, num_kv_heads, block_size):
    gen = torch.Generator().manual_seed(head_dim * 31 + num_kv_heads)
    num_blocks, num_tokens = 7, 40
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # key/value are views into a fused [T, (Hq + 2 Hkv), D] projection, as a model produces them.
    num_q_heads = 2 * num_kv_heads
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key = qkv[:, num_q_heads : num_q_heads + num_kv_heads]  # [T, Hkv, D], not contiguous
    value = qkv[:, num_q_heads + num_kv_heads :]
    # Distinct slots scattered over the cache; every fifth token is padding (slot -1).
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[::5] = -1

    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, k_expected, v_expected, slot_mapping)
    write_kv(key, value, k_cache, v_cache, slot_mapping)

    # Written slots hold the new rows; all other slots (padding targets included) are untouched.
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)
    written = slot_mapping[slot_mapping >= 0]
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[written], key[slot_mapping >= 0])


def test_write_kv_all_padding_leaves_cache_untouched():
    k_cache = torch.randn(2, 16, 2, 64)
    v_cache = torch.randn(2, 16, 2, 64)
    before = (k_cache.clone(), v_cache.clone())
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    write_kv(key, value, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_write_kv_rounds_into_fp8_caches_as_the_reference(dtype, cache_dtype):
    # values over every binade a cache holds: its subnormals, its ties, past its largest
    # (E4M3's 448, E5M2's 57344: saturated), and zeros of both signs, bit for bit
    gen = torch.Generator().manual_seed(8)
    num_tokens, num_kv_heads, head_dim = 64, 2, 32
    magnitude = torch.exp2(torch.randint(-20, 18, (num_tokens, num_kv_heads, head_dim),
                                         generator=gen).float())
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * magnitude).to(dtype)
    value = key.flip(0).clone()
    key[0, 0, :4] = torch.tensor([0.0, -0.0, -1e-30, 2.0 ** -10 * 1.5])
    caches = [torch.zeros(8, 16, num_kv_heads, head_dim, dtype=cache_dtype) for _ in range(6)]
    slots = torch.randperm(8 * 16, generator=gen)[:num_tokens]
    write_kv_ref(key, value, caches[0], caches[1], slots)
    write_kv(key, value, caches[2], caches[3], slots)  # Triton's
    portable.write_kv(key, value, caches[4], caches[5], slots)  # the CPU wing's torch path
    for got, want in zip(caches[2:], caches[:2] * 2):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    largest = torch.finfo(cache_dtype).max
    assert (key.float().abs() > largest).any()  # (saturation was exercised)
    assert caches[0].float().abs().max() == largest
