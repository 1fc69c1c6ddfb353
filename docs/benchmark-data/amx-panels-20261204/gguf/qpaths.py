"""SmolLM2-shaped Q4_1 layers (as loaded: interleaved where the VNNI kernels run): the integer
path, the dequantized panels, and (192+) the whole dequantized weight through torch, per rows."""
import sys, time
import numpy as np
import torch
sys.path.insert(0, "/work/main/tests/kernels")
import gguf_blocks as gb
from actorlm.kernels.cpu import quant

rng = np.random.default_rng(0)
shapes = {"gate_up": (3072, 576), "down": (576, 1536), "qkv": (960, 576)}
layers = {}
for name, (n, k) in shapes.items():
    blocks = gb.random_blocks("Q4_1", n, k, rng)
    layers[name] = [quant.QuantLinear([gb.quantized_weight("Q4_1", blocks, k)], None) for _ in range(10)]

def t(fn, reps=5):
    fn()
    ts = []
    for _ in range(reps):
        a = time.perf_counter(); fn(); ts.append(time.perf_counter() - a)
    ts.sort(); return ts[reps // 2] * 1000

for rows in [int(r) for r in sys.argv[1:]] or (8, 16, 32, 64, 128, 192, 256, 512):
    out = []
    for name, ls in layers.items():
        x = torch.randn(rows, shapes[name][1]).bfloat16()
        res = {}
        for path, override in (("int", 1 << 30), ("panel", 1)):
            quant.set_panel_from_rows(override)
            res[path] = t(lambda: [l(x) for l in ls]) / len(ls)
        quant.set_panel_from_rows(None)
        res["default"] = t(lambda: [l(x) for l in ls]) / len(ls)
        out.append(f"{name}: " + " ".join(f"{p} {v:.3f}" for p, v in res.items()))
    print(rows, " | ".join(out), flush=True)
