"""The quantized linear kernels (``kernels/cpu/quant.py``) on SmolLM2-135M's shapes, against
dense bf16 layers of the same shape: ``F.linear`` and actorlm's own panel kernel
(``kernels/cpu/linear.py``'s ``PanelLinear``, what a bf16 model's decode runs).

    python benchmarks/quant_gemv.py [--isa vnni|avx2|scalar] [--m 1,2,4,8,16,64] [--runs 7]
        [--shapes 576x576,...] [--types Q8_0,...] [--paths]

Each layer is copied until its copies fill more than the last-level cache (``--cold-mb``), and
one timed run calls every copy once in turn: the weights come from memory, as in a decode step
that streams the whole model, not from a cache that a repeated call would keep warm. The
kernel is called as the one-call decode step calls it (ctypes straight into the library, no
Python layer around it). Prints one JSON document: per shape, type and m, the median and the
least time per call over ``--runs`` runs and the weight bytes read per second at the median.
``--paths`` times each m on both of the kernel's paths (integer dot products; dequantized
panels) instead, to place the threshold between them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from actorlm.kernels.backend import QuantizedWeight
from actorlm.kernels.cpu import linear, native, quant

# (out_features, in_features): q and o, k and v, gate and up, down, the LM head
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
TYPES_32 = ("Q8_0", "Q4_1", "Q4_0", "Q5_0")
TYPES_256 = ("Q4_K", "Q5_K", "Q6_K")  # only where in_features is a multiple of 256


def _random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of ``type_name``: quantized by gguf where it can, else random bytes with
    small positive f16 scales (timing does not depend on the values)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    if type_name in TYPES_32:
        return gguf.quants.quantize(rng.standard_normal((rows, k), dtype=np.float32), qtype)
    blocks = rng.integers(0, 256, size=(rows * k // values, size), dtype=np.uint8)
    scales = np.full((blocks.shape[0], 1), 0.01, dtype=np.float16).view(np.uint8)
    if type_name == "Q6_K":
        blocks[:, 208:210] = scales
    else:
        blocks[:, 0:2] = blocks[:, 2:4] = scales
    return blocks.reshape(rows, -1)


def _times_ms(calls: list, runs: int) -> tuple[float, float]:
    """(median, least) time of one call, each run calling every copy once."""
    for call in calls[:3]:  # warm up the code paths, not the weights
        call()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for call in calls:
            call()
        times.append((time.perf_counter() - start) / len(calls))
    return statistics.median(times) * 1e3, min(times) * 1e3


def _kernel_calls(layers: list, x: torch.Tensor) -> list:
    """Each layer's kernel on x, called as the decode step calls it."""
    fn = native.function(f"actorlm_quant_linear_{native.dtype_suffix(x.dtype)}")
    y = torch.empty(x.shape[0], layers[0].out_features, dtype=x.dtype)
    m, x_ptr, stride, y_ptr = x.shape[0], x.data_ptr(), x.stride(0), y.data_ptr()
    return [lambda ref=ctypes.byref(layer.struct), keep=(x, y): fn(ref, x_ptr, stride, y_ptr, m)
            for layer in layers]  # keep: x and y live as long as the calls


def _record(shape, kind, m, median, least, num_bytes, **extra) -> dict:
    return {"shape": list(shape), "type": kind, "m": m, "ms": round(median, 4),
            "min_ms": round(least, 4), "GBps": round(num_bytes / median / 1e6, 1), **extra}


def _copies(num_bytes: int, cold_mb: float) -> int:
    return max(2, int(cold_mb * 2**20 // num_bytes) + 1)


def _quantized(args, shape, type_name, rng) -> list[dict]:
    n, k = shape
    blocks = torch.from_numpy(_random_blocks(type_name, n, k, rng))
    layers = [quant.QuantLinear([QuantizedWeight(type_name, blocks.clone(), (n, k))], None)
              for _ in range(_copies(blocks.numel(), args.cold_mb))]
    out = []
    for m in args.m:
        x = torch.randn(m, k).to(args.dtype)
        if args.paths:
            timed = {}
            for path, rows in (("integer", 1 << 30), ("panels", 1)):
                quant.set_panel_from_rows(rows)
                timed[path] = _times_ms(_kernel_calls(layers, x), args.runs)
            quant.set_panel_from_rows(None)
            out.append(_record(shape, type_name, m, *timed["integer"], blocks.numel(),
                               panels_ms=round(timed["panels"][0], 4),
                               panel_from=layers[0].panel_from_rows(args.dtype)))
        else:
            out.append(_record(shape, type_name, m, *_times_ms(_kernel_calls(layers, x),
                                                               args.runs), blocks.numel()))
    return out


def _dense(args, shape) -> list[dict]:
    n, k = shape
    weight = torch.randn(n, k).bfloat16()
    weights = [weight.clone() for _ in range(_copies(weight.numel() * 2, args.cold_mb))]
    panels = [linear.PanelLinear.build(w, None, wide=lambda x, w=w: F.linear(x, w)) for w in weights]
    out = []
    for m in args.m:
        x = torch.randn(m, k).bfloat16()
        out.append(_record(shape, "bf16 F.linear", m, *_times_ms(
            [lambda w=w: F.linear(x, w) for w in weights], args.runs), weight.numel() * 2))
        if panels[0] is not None and (panels[0].max_rows is None or m <= panels[0].max_rows):
            out.append(_record(shape, "bf16 PanelLinear", m, *_times_ms(
                [lambda p=p: p(x) for p in panels], args.runs), weight.numel() * 2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--isa", default=None)
    parser.add_argument("--m", default="1,2,4,8,16,64")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--cold-mb", type=float, default=96.0)
    parser.add_argument("--shapes", default=None, help="e.g. 576x576,49152x576")
    parser.add_argument("--types", default=None, help="e.g. Q8_0,Q4_1")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--paths", action="store_true")
    args = parser.parse_args()
    if args.isa:
        quant.set_isa(args.isa)
    args.m = [int(m) for m in args.m.split(",")]
    args.dtype = getattr(torch, args.dtype)
    shapes = SHAPES if args.shapes is None else [
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    wanted = None if args.types is None else set(args.types.split(","))
    rng = np.random.default_rng(0)
    results = []
    for shape in shapes:
        k = shape[1]
        types = [t for t in (*TYPES_32, *TYPES_256)
                 if k % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0] == 0
                 and (wanted is None or t in wanted)]
        if shape[0] > 10_000 and wanted is None:
            types = ["Q8_0"]  # the LM head: a GGUF keeps it (the token embedding) in Q8_0
        for type_name in types:
            results += _quantized(args, shape, type_name, rng)
        if not args.paths:
            results += _dense(args, shape)
    print(json.dumps({"isa": quant.isa(), "threads": torch.get_num_threads(),
                      "dtype": str(args.dtype), "results": results}, indent=1))


if __name__ == "__main__":
    main()
