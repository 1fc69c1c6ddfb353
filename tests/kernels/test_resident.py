"""kernels.resident: weights' blocks copied into anonymous huge-page memory."""

import pathlib

import pytest
import torch

from actorlm.kernels import resident as resident_module
from actorlm.kernels.resident import resident


def _mapping_field(address: int, field: str) -> int:
    """``field`` (kB) of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and head == f"{field}:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_copy_holds_the_same_values_in_memory_of_its_own():
    source = torch.arange(3 * 100, dtype=torch.int16).view(3, 100)[:, ::2]  # not contiguous
    copy = resident(source)
    assert torch.equal(copy, source) and copy.dtype == source.dtype
    assert copy.is_contiguous() and copy.data_ptr() % 64 == 0
    source[0, 0] = 7
    assert copy[0, 0] == 0  # a copy, not a view


def test_takes_follow_one_another_on_cache_lines_and_a_big_one_gets_its_own_chunk():
    chunks = resident_module._Chunks()
    first, second = chunks.take(10), chunks.take(12)
    assert first.data_ptr() % (2 << 20) == 0 and second.data_ptr() - first.data_ptr() == 64
    big = chunks.take(resident_module._CHUNK + 1)
    assert big.numel() == resident_module._CHUNK + 1 and big.data_ptr() % (2 << 20) == 0
    assert chunks.take(1).data_ptr() == big.data_ptr() + resident_module._CHUNK + 64


def test_the_kernel_maps_the_copies_in_huge_pages_where_it_grants_them():
    setting = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        pytest.skip("this kernel grants no transparent huge pages")
    copy = resident(torch.ones(8 << 20, dtype=torch.uint8))
    assert _mapping_field(copy.data_ptr(), "AnonHugePages") >= 2048
