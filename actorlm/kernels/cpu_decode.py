"""Decode attention straight from the paged KV cache on a CPU (``csrc/cpu_paged_decode.cpp``).

The torch path gathers each request's K/V blocks into a dense copy and runs SDPA over it: on
two cores that is ~1.2 ms per layer for 64 decode rows at context 140, where reading the
context once costs ~0.35 ms. The C++ kernel reads the blocks in place, costs each request only
its own context, and runs on torch's OpenMP pool.

The library is compiled on first use with the system's C++ compiler (``$CXX``, else ``g++``,
about a second) for this very CPU (``-march=native``) and cached under
``~/.cache/actorlm/kernels`` keyed by the source, the flags, the compiler and the CPU's
features. Where it cannot be built (no compiler) the torch path runs instead, after one
warning; ``ACTORLM_CPU_DECODE_KERNEL=0`` turns it off on purpose (to compare the two).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import torch

from actorlm.paths import cache_root

log = logging.getLogger(__name__)

_SOURCE = pathlib.Path(__file__).parent / "csrc" / "cpu_paged_decode.cpp"
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
_SYMBOLS = {torch.float32: "actorlm_decode_f32", torch.bfloat16: "actorlm_decode_bf16"}


class _Library:
    def __init__(self, cdll: ctypes.CDLL):
        limits = [ctypes.c_int() for _ in range(3)]
        cdll.actorlm_decode_limits(*map(ctypes.byref, limits))
        self.max_group, self.max_head_dim, self.max_block_size = (v.value for v in limits)
        self.functions = {}
        for dtype, name in _SYMBOLS.items():
            function = getattr(cdll, name)
            function.restype = None
            function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float]
            self.functions[dtype] = function


def is_built(block_size: int) -> bool:
    """Whether the kernel runs here, for caches of ``block_size`` tokens a block."""
    lib = _library()
    return lib is not None and block_size <= lib.max_block_size


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
             block_size: int) -> bool:
    """Whether decode rows of this shape can run here (the library built, the shape in its
    limits); otherwise the torch path attends them."""
    lib = _library()
    return is_built(block_size) and dtype in lib.functions and \
        num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= lib.max_group and \
        head_dim <= lib.max_head_dim


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           rows: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per request over its paged context.

    query: [T, Hq, D] (rows may be strided); caches: [num_blocks, block_size, Hkv, D];
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (>= 1); rows: [B] int32, the
    query row of each request (None: row b is request b, T == B). Writes those rows of
    ``out`` ([T, Hq, D], contiguous; allocated if None) and returns it. Only where
    ``supports(...)`` holds."""
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_requests = block_tables.shape[0]
    assert query.stride(2) == 1 and query.stride(1) == head_dim, "query heads must be dense"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and \
        k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype == query.dtype
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and \
        block_tables.is_contiguous() and seq_lens.is_contiguous()
    assert seq_lens.shape == (num_requests,)
    if rows is None:
        assert num_tokens == num_requests
    else:
        assert rows.dtype == torch.int32 and rows.is_contiguous() and rows.shape == seq_lens.shape
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    assert out.is_contiguous() and out.shape == query.shape and out.dtype == query.dtype
    _library().functions[query.dtype](
        query.data_ptr(), query.stride(0), None if rows is None else rows.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        seq_lens.data_ptr(), out.data_ptr(), num_requests, num_heads, num_kv_heads, head_dim,
        block_size, scale)
    return out


@functools.cache
def _library() -> _Library | None:
    if os.environ.get("ACTORLM_CPU_DECODE_KERNEL", "1").strip() == "0":
        return None
    try:
        return _Library(ctypes.CDLL(str(_build())))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("the CPU decode-attention kernel could not be built (%s); decode rows "
                    "attend through the slower torch path", exc)
        return None


def _build() -> pathlib.Path:
    """The compiled library, built once per source, compiler and CPU."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise OSError("no C++ compiler (set CXX or install g++)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    key = hashlib.sha256("\0".join(
        [_SOURCE.read_text(), " ".join(_COMPILE_FLAGS), version, _cpu_features()]).encode())
    target = cache_root() / "kernels" / f"cpu_paged_decode-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = pathlib.Path(tmp, "kernel.o"), pathlib.Path(tmp, "kernel.so")
        # -ffast-math only to compile: linking with it would add crtfastmath.o (flush-to-zero
        # for the whole process, torch included)
        for command in ([compiler, "-c", *_COMPILE_FLAGS, str(_SOURCE), "-o", str(obj)],
                        [compiler, "-shared", "-fopenmp", str(obj), "-o", str(lib), "-lmvec"]):
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise OSError(f"{' '.join(command[:2])} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, target)  # atomic: another process building it too is harmless
    return target


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
