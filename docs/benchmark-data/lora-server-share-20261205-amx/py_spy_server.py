import subprocess, sys, time
sys.path.insert(0, "/work/main/benchmarks")
from serve_backends import serving
from actorlm.bench.serve import run_serve_benchmark
import psutil
streams = int(sys.argv[1])
with serving(8128, ["--dtype", "auto"]) as url:
    server = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and "actorlm.api.cli" in " ".join(p.info["cmdline"])][0]
    spy = subprocess.Popen(["/work/main/.venv/bin/py-spy", "record", "-p", str(server.pid), "-r", "200", "-d", "20", "-f", "raw", "-o", f"/tmp/prof/spy{streams}.txt", "--threads", "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    r = run_serve_benchmark(url, 4 * streams if streams > 1 else 12, endpoint="/v1/chat/completions", max_tokens=128, max_concurrency=streams, ignore_eos=True)
    print("tok/s", r["output_throughput"], "tokens", r.get("total_output_tokens"))
    spy.wait()
