"""Per-thread CPU (ms per output token) of the server and core processes during a served run.
usage: python thread_cpu.py STREAMS [REQUESTS_PER_STREAM]"""
import json, os, subprocess, sys, time, glob
sys.path.insert(0, "/work/main/benchmarks")
from serve_backends import serving
from actorlm.bench.serve import run_serve_benchmark
import psutil

streams = int(sys.argv[1]); per = int(sys.argv[2]) if len(sys.argv) > 2 else 3

def thread_times(pids):
    out = {}
    for pid in pids:
        for tid_dir in glob.glob(f"/proc/{pid}/task/*"):
            tid = int(tid_dir.rsplit("/", 1)[1])
            try:
                name = open(f"{tid_dir}/comm").read().strip()
                st = open(f"{tid_dir}/stat").read().rsplit(")", 1)[1].split()
                out[(pid, tid, name)] = (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")
            except OSError:
                pass
    return out

with serving(8126, ["--dtype", "auto"]) as url:
    server = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and "serve" in " ".join(p.info["cmdline"]) and "actorlm" in " ".join(p.info["cmdline"])]
    pids = set()
    for p in server:
        pids.add(p.pid); pids.update(c.pid for c in p.children(recursive=True))
    run_serve_benchmark(url, 2, endpoint="/v1/chat/completions", max_tokens=16, max_concurrency=1, ignore_eos=True)
    before = thread_times(pids); me0 = os.times()
    t0 = time.time()
    r = run_serve_benchmark(url, per * streams, endpoint="/v1/chat/completions", max_tokens=128, max_concurrency=streams, ignore_eos=True)
    wall = time.time() - t0
    after = thread_times(pids); me1 = os.times()
    tokens = r["total_output_tokens"] if "total_output_tokens" in r else r["output_throughput"] * wall
    print("tok/s", r["output_throughput"], "tokens", tokens)
    rows = []
    for k, v in after.items():
        d = v - before.get(k, 0)
        if d > 0: rows.append((d * 1000 / tokens, k))
    by_pid = {}
    for ms, (pid, tid, name) in sorted(rows, reverse=True):
        by_pid.setdefault(pid, 0); by_pid[pid] += ms
        print(f"{ms:8.4f} ms/token  pid {pid} {name}")
    print("client", (me1.user + me1.system - me0.user - me0.system) * 1000 / tokens, "ms/token (this process)")
    print("by pid", by_pid)
