"""The CPU kernels written in C++ (``csrc/*.cpp``), built into one library on first use.

They are compiled with the system's C++ compiler (``$CXX``, else ``g++``: a couple of seconds)
for this very CPU (``-march=native``), cached under ``~/.cache/actorlm/kernels`` keyed by the
sources, the ABI (``abi.py``, whose header every source includes), the flags, the compiler and
the CPU's features, and loaded with ctypes. The library
links the libgomp that torch has already loaded (the same soname), so its parallel loops run
on torch's own OpenMP pool rather than a second one fighting it for the cores.

Where it cannot be built (no compiler) every caller falls back to its torch path, after one
warning; ``ACTORLM_CPU_KERNELS=0`` turns the library off on purpose (to compare the two).
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

from actorlm.kernels.cpu import abi
from actorlm.paths import cache_root

log = logging.getLogger(__name__)

_CSRC = pathlib.Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_FILES = sorted(_CSRC.glob("*.[ch]*"))  # sources and headers: what the build depends on
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None where it cannot be (then the torch paths run)."""
    if os.environ.get("ACTORLM_CPU_KERNELS", "1").strip() == "0":
        return None
    try:
        return ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("the C++ CPU kernels could not be built (%s); the slower torch paths run "
                    "instead", exc)
        return None


@functools.cache
def function(name: str) -> ctypes._CFuncPtr | None:
    """The exported function ``name`` with its ctypes signature from ``abi``, or None without
    a library."""
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = abi.signature(name)
    return fn


@functools.cache
def has_amx() -> bool:
    """Whether this CPU has AMX tiles (which torch's bf16 GEMM, oneDNN's, then runs on)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())  # (private)


def dtype_suffix(dtype: torch.dtype) -> str | None:
    """The suffix of the library's functions for ``dtype`` (``_f32``, ``_bf16``), or None where
    it has none."""
    return {torch.float32: "f32", torch.bfloat16: "bf16"}.get(dtype)


# a KV cache's FP8 formats: the kernels' suffix and the decode step's kv_type (``abi``)
FP8_CACHES = {torch.float8_e4m3fn: ("e4m3", 1), torch.float8_e5m2: ("e5m2", 2)}


def cache_suffix(dtype: torch.dtype, cache_dtype: torch.dtype) -> str | None:
    """The suffix of a kernel that reads or writes a KV cache of ``cache_dtype`` with values
    of ``dtype`` (``_bf16``, ``_bf16_e4m3``), or None where the library has none."""
    suffix = dtype_suffix(dtype)
    if suffix is None or cache_dtype == dtype:
        return suffix
    return f"{suffix}_{FP8_CACHES[cache_dtype][0]}" if cache_dtype in FP8_CACHES else None


def _build() -> pathlib.Path:
    """The compiled library, built once per sources, compiler and CPU."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise OSError("no C++ compiler (set CXX or install g++)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    header = abi.header()
    key = hashlib.sha256("\0".join(
        [*(f.read_text() for f in _FILES), header, " ".join(_COMPILE_FLAGS), version,
         _cpu_features()]).encode())
    target = cache_root() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [pathlib.Path(tmp, f"{source.stem}.o") for source in _SOURCES]
        lib = pathlib.Path(tmp, "kernels.so")
        pathlib.Path(tmp, "actorlm_abi.h").write_text(header)
        # -ffast-math only to compile: linking with it would add crtfastmath.o (flush-to-zero
        # for the whole process, torch included)
        commands = [[compiler, "-c", *_COMPILE_FLAGS, f"-I{tmp}", str(source), "-o", str(obj)]
                    for source, obj in zip(_SOURCES, objects)]
        commands.append([compiler, "-shared", "-fopenmp", *map(str, objects), "-o", str(lib),
                         "-lmvec"])
        for command in commands:
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
