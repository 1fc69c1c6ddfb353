import sys, json
sys.path.insert(0, "/work/main/benchmarks")
from serve_backends import serving
from actorlm.bench.serve import run_serve_benchmark
with serving(8127, ["--dtype", sys.argv[1]]) as url:
    for _ in range(3):
        r = run_serve_benchmark(url, 3, endpoint="/v1/chat/completions", max_tokens=128, max_concurrency=1, ignore_eos=True)
        print({k: round(v, 2) for k, v in r.items() if isinstance(v, float) and any(s in k for s in ("ttft", "tpot", "itl", "throughput", "duration"))})
