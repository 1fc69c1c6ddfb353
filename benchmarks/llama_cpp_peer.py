"""llama.cpp (llama-cpp-python) decoding one stream of a GGUF file: the peer of
``actorlm bench latency`` on the same file (a 32-token prompt, 128 greedy tokens, 2 threads).

    PYTHON_WITH_LLAMA_CPP benchmarks/llama_cpp_peer.py FILE.gguf [--threads 2]

llama-cpp-python is not a dependency of the project (it compiles llama.cpp from source:
``CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python`` in a venv of its own). Prints one
JSON line: the median over three runs of decode tokens/s (after the first token) and TTFT.
"""

import argparse
import json
import statistics
import time

from llama_cpp import Llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    llm = Llama(model_path=args.path, n_ctx=1024, n_threads=args.threads, n_batch=512,
                verbose=False)
    prompt = list(range(100, 100 + args.input_len))
    runs = []
    for _ in range(3):
        start, first, count = time.perf_counter(), None, 0
        for _token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            count += 1
            first = first or time.perf_counter()
            if count == args.output_len:
                break
        end = time.perf_counter()
        runs.append({"ttft_ms": (first - start) * 1e3,
                     "decode_tokens_per_s": (count - 1) / (end - first)})
    print(json.dumps({"peer": "llama-cpp-python", "threads": args.threads,
                      **{k: round(statistics.median(r[k] for r in runs), 2)
                         for k in ("decode_tokens_per_s", "ttft_ms")}}))


if __name__ == "__main__":
    main()
