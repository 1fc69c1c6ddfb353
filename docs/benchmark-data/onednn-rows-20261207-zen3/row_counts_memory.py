"""Resident memory after fp32 linear layers of SmolLM2's four shapes ran 400 row counts (17 to
416), and the time of a few row counts, through ``packed_linear``; then what malloc_trim gives
back. Run before and after the change (git stash)."""
import time, torch
from actorlm.kernels.cpu.linear import packed_linear
torch.set_num_threads(2)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
layers = [packed_linear(torch.randn(n, k), None) for k, n in [(576, 960), (576, 576), (576, 3072), (1536, 576)]]
def run(m):
    for k_i, l in zip([576, 576, 576, 1536], layers):
        l(torch.randn(m, k_i))
run(20); r0 = rss(); t = time.perf_counter()
for m in range(17, 417): run(m)
print("400 row counts: rss growth MiB", round(rss() - r0, 1), "s", round(time.perf_counter() - t, 2))
for m in (17, 33, 49, 64, 65, 128, 512):
    xs = [torch.randn(m, k) for k in (576, 576, 576, 1536)]
    t = time.perf_counter()
    for _ in range(20):
        for l, x in zip(layers, xs): l(x)
    print(m, "rows: ms per 4 layers", round((time.perf_counter() - t) / 20 * 1e3, 3))
import ctypes
before = rss()
ctypes.CDLL("libc.so.6").malloc_trim(0)
print("after malloc_trim: rss dropped MiB", round(before - rss(), 1))
