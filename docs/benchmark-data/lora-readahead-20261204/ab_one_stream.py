# same-hour A/B of one-stream LoRA decode: trees alternate, each a fresh process
import json, subprocess, sys, statistics, os
trees = {"before": "/tmp/ab-base", "after": "/work/main"}
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
res = {k: [] for k in trees}
for r in range(rounds):
    for name, tree in trees.items():
        out = subprocess.run(["/work/main/.venv/bin/actorlm", "bench", "latency", "--batch-size", "1",
                              "--output-len", "128", "--num-iters", "7", "--enable-lora",
                              "--lora-path", "/tmp/smollm2-lora/lora-1", "--json"],
                             env={**os.environ, "PYTHONPATH": tree, "HF_HUB_OFFLINE": "1"},
                             capture_output=True, text=True, cwd="/tmp").stdout
        d = json.loads(out.strip().splitlines()[-1])
        res[name].append(d["decode_ratio_lora_vs_base"])
        print(name, d["tpot_ms"], d["lora_tpot_ms"], d["decode_ratio_lora_vs_base"], flush=True)
for k, v in res.items():
    print(k, "median", statistics.median(v), v)
