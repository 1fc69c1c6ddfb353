"""One MoE layer's experts over a prefill: the panels (on AMX tiles) against torch's GEMM
over the unpacked weights (experts.py's other path)."""
import torch, time
from actorlm.kernels import Experts, moe
from actorlm.kernels.cpu import experts as E
torch.manual_seed(0)
H, I, NE, K = 1024, 1024, 16, 2
ex = Experts((torch.randn(NE, 2 * I, H) * 0.02).bfloat16(), (torch.randn(NE, H, I) * 0.02).bfloat16(), "silu")
pe = E.PanelExperts.build(ex)
for tokens in (128, 256, 512, 1024, 2048):
    x = torch.randn(tokens, H).bfloat16()
    w, ids = moe.route(torch.randn(tokens, NE), K, True)
    res = {}
    for name, unpack in (("panels", False), ("unpacked", True)):
        pe._on_amx = lambda num_slots: unpack  # the step's path, forced
        pe.run(x, w, ids)
        ts = []
        for _ in range(5):
            t = time.perf_counter(); pe.run(x, w, ids); ts.append(time.perf_counter() - t)
        ts.sort(); res[name] = round(ts[2] * 1000, 1)
    print(tokens, "rows/expert", tokens * K // NE, res)
