import time, torch, statistics
import torch.nn.functional as F
from actorlm.kernels.cpu import linear
k = linear._kernel(torch.float32)
print("panel", None if k is None else k.panel)
torch.manual_seed(0)
for n, kk in ((2048, 1024), (1024, 1024), (49152, 1024)):
    w = torch.randn(n, kk)
    p = linear.PanelLinear.build(w, None)
    for rows in (1, 2, 4, 8, 16, 64):
        x = torch.randn(rows, kk)
        ref = F.linear(x, w)
        got = p(x)
        err = (got - ref).abs().max().item()
        def t(f, reps):
            f(); ts = []
            for _ in range(reps):
                a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
            return statistics.median(ts) * 1e3
        reps = 30 if n < 10000 else 5
        tm, tp = t(lambda: F.linear(x, w), reps), t(lambda: p(x), reps)
        print(f"{n}x{kk} rows {rows}: mkl {tm:.3f} ms panel {tp:.3f} ms ratio {tp/tm:.2f}  GB/s panel {n*kk*4/tp/1e6:.1f} err {err:.2e}")
