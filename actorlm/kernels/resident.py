"""Host memory for weights held in blocks: anonymous memory in 2 MiB pages.

A one-stream decode step reads every weight once, so each 4 KiB page of it costs a TLB miss
(in a virtual machine, a walk through two page tables): SmolLM2's 95 MB of blocks span 23,000
such pages, and 48 huge ones. ``resident`` copies a weight's blocks into chunks that ask the
kernel for transparent huge pages (``madvise``: Linux's usual setting grants them to whoever
asks); where they are not granted the chunks are ordinary anonymous memory. The blocks are
then also the process's own, not a memory-mapped file's pages: a model holds each weight once,
and the file can be closed.
"""

from __future__ import annotations

import mmap
import threading

import torch

_HUGE_PAGE = 2 << 20
_CHUNK = 32 << 20  # taken from the kernel at a time; its untouched pages cost nothing
_ALIGN = 64  # each copy starts on a cache line, as the kernels' loads like


class _Chunks:
    """Bump allocation out of huge-page chunks; a chunk lives while a tensor points into it."""

    def __init__(self):
        self._lock = threading.Lock()  # tensor-parallel ranks may load in threads
        self._chunk, self._used = torch.empty(0, dtype=torch.uint8), 0

    def take(self, num_bytes: int) -> torch.Tensor:
        with self._lock:
            if self._used + num_bytes > self._chunk.numel():
                self._chunk, self._used = _huge_pages(max(_CHUNK, num_bytes)), 0
            start, self._used = self._used, -(-(self._used + num_bytes) // _ALIGN) * _ALIGN
            return self._chunk[start:start + num_bytes]


def _huge_pages(num_bytes: int) -> torch.Tensor:
    """``num_bytes`` (rounded up to huge pages) of anonymous memory starting on a huge page."""
    size = -(-num_bytes // _HUGE_PAGE) * _HUGE_PAGE
    memory = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        memory.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(memory, dtype=torch.uint8)  # keeps the mapping alive
    skip = -whole.data_ptr() % _HUGE_PAGE
    return whole[skip:skip + size]


_chunks = _Chunks()


def empty(num_bytes: int) -> torch.Tensor:
    """``num_bytes`` uninitialised bytes (uint8) in huge-page memory."""
    return _chunks.take(num_bytes)


def resident(blocks: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``blocks`` (a CPU tensor) in huge-page memory."""
    copy = _chunks.take(blocks.numel() * blocks.element_size())
    copy = copy.view(blocks.dtype).view(blocks.shape)
    copy.copy_(blocks)
    return copy
