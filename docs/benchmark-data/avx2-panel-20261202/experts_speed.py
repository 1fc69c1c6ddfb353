import time, torch, statistics
from actorlm.kernels import Experts, moe
from actorlm.kernels.cpu import experts as cpu_experts
torch.manual_seed(0)
E, H, I, K = 16, 1024, 1024, 2
gate_up = torch.randn(E, 2 * I, H) * 0.02
down = torch.randn(E, H, I) * 0.02
plain = Experts(gate_up, down, "silu")
panel = cpu_experts.PanelExperts.build(plain)
def t(f, reps=3):
    f(); ts = []
    for _ in range(reps):
        a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e3
for T in (1, 8, 64, 256, 1024):
    x = torch.randn(T, H); logits = torch.randn(T, E)
    tp = t(lambda: panel(x, logits, K, True))
    tt = t(lambda: moe.fused_moe(x, logits, plain, K, True))
    print(f"T={T}: panel {tp:.1f} ms torch {tt:.1f} ms ratio {tp/tt:.2f}")
