"""The engine offline on bench serve's random 256/128 prompts, max_num_seqs = concurrency."""
import json, sys, time
from actorlm import LLM, SamplingParams
from actorlm.bench.datasets import DatasetOptions, sample_requests
from transformers import AutoTokenizer

model, conc = sys.argv[1], int(sys.argv[2])
tok = AutoTokenizer.from_pretrained("/tmp/smollm2-dense")
reqs = sample_requests(DatasetOptions(name="random", random_input_len=256, random_output_len=128), 192, tok)
llm = LLM(model=model, max_num_seqs=conc)
llm.generate([reqs[0].prompt], SamplingParams(max_tokens=8), use_tqdm=False)
t0 = time.perf_counter()
outs = llm.generate([r.prompt for r in reqs], SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0), use_tqdm=False)
dt = time.perf_counter() - t0
n = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"model": model, "concurrency": conc, "output_throughput": round(n / dt, 1), "elapsed_s": round(dt, 2)}))
