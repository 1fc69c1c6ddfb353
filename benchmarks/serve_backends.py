"""The server's process layouts: ``core`` (the engine core in a process of its own, its worker
a thread there: the default), ``mp`` (the engine in the server's process, its worker in a
process of its own) and ``uni`` (everything in the server's process).

    python benchmarks/serve_backends.py [--backends core mp] [--streams 1 16 64] [--rounds 3]
        [--max-tokens 128] [--dtype float32] [--port 8123]

For each round and each layout (taking turns, so drift in a shared machine hits both alike):
start ``actorlm serve`` with its flags (``LAYOUTS``), wait until it answers, run
``actorlm bench serve`` (chat, EOS ignored, all requests at once, ``--max-concurrency`` =
streams, 3 requests per stream) at every stream count, stop the server. Prints one JSON line
per measurement and, last, one JSON object with the medians per backend and stream count and
their ratio to the first backend.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

from actorlm.bench.serve import run_serve_benchmark


LAYOUTS = {
    "core": ["--engine-core-process", "--distributed-executor-backend", "uni"],
    "mp": ["--no-engine-core-process", "--distributed-executor-backend", "mp"],
    "uni": ["--no-engine-core-process", "--distributed-executor-backend", "uni"],
}


def _wait_ready(base_url: str, server: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("the server did not come up")


@contextlib.contextmanager
def serving(port: int, flags: list[str], env: dict | None = None):
    """``actorlm serve`` with ``flags`` on ``port`` (in ``env``), up and warmed; its base URL.
    Stopped with SIGTERM on leaving."""
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "actorlm.api.cli", "serve", "--port", str(port), *flags]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=env or {**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        _wait_ready(base_url, server)
        run_serve_benchmark(base_url, 2, endpoint="/v1/chat/completions", max_tokens=8)  # warm
        yield base_url
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


def _measure(backend: str, args) -> list[dict]:
    with serving(args.port, ["--dtype", args.dtype, *LAYOUTS[backend]]) as base_url:
        rows = []
        for streams in args.streams:
            result = run_serve_benchmark(base_url, 3 * streams, endpoint="/v1/chat/completions",
                                         max_tokens=args.max_tokens, max_concurrency=streams,
                                         ignore_eos=True)
            if result["failed"]:
                raise RuntimeError(f"{backend}, {streams} streams: {result['errors']}")
            rows.append({"backend": backend, "streams": streams,
                         "output_throughput": result["output_throughput"],
                         "ttft_ms_p50": result["median_ttft_ms"],
                         "itl_ms_p50": result["median_itl_ms"]})
            print(json.dumps(rows[-1]), flush=True)
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["core", "mp"], choices=list(LAYOUTS))
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    rows = []
    for _ in range(args.rounds):
        for backend in args.backends:
            rows += _measure(backend, args)
    summary = {}
    for streams in args.streams:
        medians = {b: {key: statistics.median(r[key] for r in rows
                                              if r["backend"] == b and r["streams"] == streams)
                       for key in ("output_throughput", "ttft_ms_p50", "itl_ms_p50")}
                   for b in args.backends}
        first = medians[args.backends[0]]["output_throughput"]
        for b in args.backends:
            medians[b]["throughput_ratio"] = round(medians[b]["output_throughput"] / first, 3)
        summary[str(streams)] = medians
    print(json.dumps({"dtype": args.dtype, "max_tokens": args.max_tokens, "rounds": args.rounds,
                      "medians": summary}))


if __name__ == "__main__":
    main()
