"""The bf16 panels on AMX tiles against oneDNN's AMX GEMM on its own layout, per row count
(layers of SmolLM2, its LM head, the test MoE's attention), each over weights cycled from memory."""
import torch, time
from actorlm.kernels.cpu import linear as L
k = L._kernel(torch.bfloat16)
torch.manual_seed(0)
def bench(n, kk, count, ms):
    Ws = [torch.randn(n, kk, dtype=torch.bfloat16) * 0.05 for _ in range(count)]
    Ps = []
    for w in Ws:
        p = L.aligned_empty(L.packed_numel(n, kk, torch.bfloat16, k), torch.bfloat16)
        k.pack(w.data_ptr(), p.data_ptr(), n, kk); Ps.append(p)
    one = [L._onednn_linear(w, None) for w in Ws]
    out = []
    for m in ms:
        x = torch.randn(m, kk, dtype=torch.bfloat16); y = torch.empty(m, n, dtype=torch.bfloat16)
        tt = {}
        for name, fn in (("amx", lambda i: k.run(x.data_ptr(), kk, Ps[i].data_ptr(), None, y.data_ptr(), m, n, kk)), ("onednn", lambda i: one[i](x))):
            ts = []
            for r in range(7):
                t = time.perf_counter()
                for i in range(count): fn(i)
                ts.append(time.perf_counter() - t)
            ts.sort(); tt[name] = ts[3] * 1000 / count
        out.append(f"{m}:{tt['onednn']/tt['amx']:.2f}x")
    print(f"{n}x{kk}", " ".join(out))
ms = (3, 8, 16, 32, 64, 96, 128, 192)
bench(3072, 576, 30, ms)   # smollm2 gate_up
bench(576, 1536, 30, ms)   # down
bench(960, 576, 30, ms)    # qkv
bench(49152, 576, 2, ms)   # lm head
bench(1024, 1024, 30, ms)  # moe q/o
