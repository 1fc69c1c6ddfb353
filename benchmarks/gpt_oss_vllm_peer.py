"""vLLM's side of ``gpt_oss_shapes.py``, run by vLLM's own interpreter:

    python gpt_oss_vllm_peer.py CHECKPOINT latency|throughput

``latency``: one request of 128 random prompt tokens, 64 output tokens (EOS ignored), a
warm-up then three timed runs, the time to the first token from a one-token run; prints
``tpot_ms``. ``throughput``: 16 such requests at once; prints ``output_tokens_per_s``. The
shapes are ``actorlm bench``'s for the same checkpoint.
"""

import json
import statistics
import sys
import time

if __name__ == "__main__":  # (vLLM starts its engine in a spawned process)
    from vllm import LLM, SamplingParams

    path, kind = sys.argv[1], sys.argv[2]
    llm = LLM(path, dtype="bfloat16", max_model_len=1024, enforce_eager=True, seed=0)
    prompts = [{"prompt_token_ids": [(7 + 31 * i + 13 * j) % 49000 + 3 for j in range(128)]}
               for i in range(16 if kind == "throughput" else 1)]

    def run(max_tokens):
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                             ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    run(4)  # warm-up
    if kind == "latency":
        first = statistics.median(run(1) for _ in range(3))
        total = statistics.median(run(64) for _ in range(3))
        print(json.dumps({"ttft_ms": round(first * 1e3, 2),
                          "tpot_ms": round((total - first) / 63 * 1e3, 2)}))
    else:
        total = statistics.median(run(64) for _ in range(3))
        print(json.dumps({"output_tokens_per_s": round(16 * 64 / total, 2)}))
