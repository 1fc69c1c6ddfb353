import json, sys, time, subprocess
from actorlm import LLM, SamplingParams
from actorlm.bench.throughput import bench_prompts
llm = LLM(max_num_seqs=16)
prompts = [{"prompt_token_ids": llm.engine.apply_chat_template(c)} for c in bench_prompts(48)]
llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
for busy, period in [(0, 0), (2, 20), (0, 0), (2, 20), (0, 0), (2, 20)]:
    p = subprocess.Popen([sys.executable, __import__('os').path.join(__import__('os').path.dirname(__file__), 'cotenant.py'), str(busy), str(period)]) if busy else None
    time.sleep(0.3)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    s = time.perf_counter() - start
    if p: p.kill(); p.wait()
    print(busy, period, 'tok/s', round(sum(len(o.outputs[0].token_ids) for o in outputs) / s, 1), flush=True)
