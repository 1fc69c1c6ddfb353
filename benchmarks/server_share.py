"""What share of the engine's offline throughput the server keeps, on the same requests.

    python benchmarks/server_share.py [--streams 1 16] [--requests-per-stream 3]
        [--max-tokens 128] [--dtype auto] [--rounds 3] [--port 8125] [--engine-cpus 0]
        [-- serve flags...]

Each round, for every stream count: the offline engine (``LLM`` with ``max_num_seqs`` =
streams, in a process of its own) generates the built-in chat prompts (``bench_prompts``,
the chat template applied), EOS ignored, all at once; then ``actorlm serve`` (its default
layout, or the flags after ``--``) gets the same conversations from ``actorlm bench serve``
(chat, streamed, ``--max-concurrency`` = streams). Output tokens per second on both sides;
the two take turns, so the machine's drift hits both alike. Prints one JSON line a
measurement and, last, the medians and the median of the rounds' server / offline ratios.

``--engine-cpus`` gives the engine cores of its own on both sides (one OpenMP thread each):
the offline process runs on them, and so does the served engine-core process (every
thread, moved there once it is up), while the server's own process and the load generator
run on the other CPUs. The ratio then measures what the server's path costs the engine,
not what its CPU takes from cores the engine's threads need.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

import psutil
from serve_backends import serving

from actorlm.bench.serve import run_serve_benchmark

_OFFLINE = textwrap.dedent("""
    import json, sys, time
    from actorlm import LLM, SamplingParams
    from actorlm.bench.throughput import bench_prompts
    streams, num, max_tokens, dtype = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    llm = LLM(dtype=dtype, max_num_seqs=streams)
    prompts = [{"prompt_token_ids": llm.engine.apply_chat_template(c)} for c in bench_prompts(num)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    print(json.dumps(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds))
""")


def offline(streams: int, args) -> float:
    pin = (lambda: os.sched_setaffinity(0, args.engine_cpus)) if args.engine_cpus else None
    out = subprocess.run([sys.executable, "-c", _OFFLINE, str(streams),
                          str(args.requests_per_stream * streams), str(args.max_tokens),
                          args.dtype], capture_output=True, text=True, check=True,
                         env=_env(args), preexec_fn=pin)
    return float(out.stdout.strip().splitlines()[-1])


def _env(args) -> dict:
    threads = {"OMP_NUM_THREADS": str(len(args.engine_cpus))} if args.engine_cpus else {}
    return {**os.environ, "HF_HUB_OFFLINE": "1", **threads}


def _pin_engine_core(cpus: list[int]) -> None:
    """Move every thread of this process's engine-core children onto ``cpus``."""
    cores = [p for p in psutil.Process().children(recursive=True)
             if "engine-core" in " ".join(p.cmdline())]
    if not cores:
        raise RuntimeError("no engine-core process to pin (is it in the server's process?)")
    for core in cores:
        for thread in core.threads():
            os.sched_setaffinity(thread.id, cpus)


def served(args) -> dict[int, float]:
    if args.engine_cpus:  # the server (and this load generator) keep off the engine's cores
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0) - set(args.engine_cpus)))
    with serving(args.port, ["--dtype", args.dtype, *args.serve_flags],
                 env=_env(args)) as base_url:
        if args.engine_cpus:
            _pin_engine_core(args.engine_cpus)
        rates = {}
        for streams in args.streams:
            result = run_serve_benchmark(base_url, args.requests_per_stream * streams,
                                         endpoint="/v1/chat/completions",
                                         max_tokens=args.max_tokens, max_concurrency=streams,
                                         ignore_eos=True)
            if result["failed"]:
                raise RuntimeError(f"{streams} streams: {result['errors']}")
            rates[streams] = result["output_throughput"]
        return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8125)
    parser.add_argument("--engine-cpus", nargs="+", type=int, default=[],
                        help="CPUs of the engine's own, on both sides (default: all shared)")
    parser.add_argument("serve_flags", nargs="*", help="after --: flags for actorlm serve")
    args = parser.parse_args()
    rows = []
    for round_ in range(args.rounds):
        rates = {s: offline(s, args) for s in args.streams}
        for streams, rate in served(args).items():
            rows.append({"round": round_, "streams": streams, "offline": rates[streams],
                         "server": rate, "ratio": rate / rates[streams]})
            print(json.dumps(rows[-1]), flush=True)
    summary = {str(s): {key: round(statistics.median(r[key] for r in rows if r["streams"] == s),
                                   3) for key in ("offline", "server", "ratio")}
               for s in args.streams}
    print(json.dumps({"dtype": args.dtype, "max_tokens": args.max_tokens,
                      "engine_cpus": args.engine_cpus,
                      "requests_per_stream": args.requests_per_stream, "rounds": args.rounds,
                      "serve_flags": args.serve_flags, "medians": summary}))


if __name__ == "__main__":
    main()
