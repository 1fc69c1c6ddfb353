import patch
import time, json, statistics
from actorlm.bench.throughput import profiled, step_breakdown
from actorlm.llm import LLM
from actorlm.lora_request import LoRARequest
from actorlm.sampling_params import SamplingParams
lora = LoRARequest("a", 1, "/tmp/smollm2-lora/lora-1")
p = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
with profiled(True) as tf:
    llm = LLM(None, trace_file=tf, enable_lora=True, max_lora_rank=16)
    prompt = [{"prompt_token_ids": list(range(100, 132))}]
    for l in (None, lora):
        llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False, lora_request=l)
    out = {"base": [], "lora": []}
    for it in range(4):
        for name, l in (("base", None), ("lora", lora)):
            since = time.monotonic()
            llm.generate(prompt, p, use_tqdm=False, lora_request=l)
            out[name].append(step_breakdown(llm, since)["decode"])
    llm.shutdown()
for name, rs in out.items():
    print(name, {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]})
import statistics as st
for k, v in patch.T.items(): print(k, len(v), [round(st.median(x[j] for x in v)*1e3, 3) for j in range(3)])
