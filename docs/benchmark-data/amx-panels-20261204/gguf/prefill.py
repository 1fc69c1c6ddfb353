"""One prompt's prefill (max_tokens=1, prefix caching off) on the shipped GGUF, bf16: medians of 5, ms."""
import json, random, statistics, sys, time
from actorlm import LLM, SamplingParams
llm = LLM(enable_prefix_caching=False)
out = {}
for n in (64, 256, 1024):
    rng = random.Random(n)
    ts = []
    for i in range(6):
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
        ts.append(1000 * (time.perf_counter() - t))
    out[n] = round(statistics.median(ts[1:]), 1)
print(json.dumps(out))
