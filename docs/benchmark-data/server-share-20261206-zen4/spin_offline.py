# python offline.py STREAMS: the offline engine at max_num_seqs=STREAMS, the built-in chat prompts
# (3 per stream) x 128 tokens, EOS ignored; output tok/s alternating alone and beside a
# process that spins 2 ms every 20 ms (0.1 of a core). GOMP_SPINCOUNT from the environment.
import json, os, sys, time, subprocess
from actorlm import LLM, SamplingParams
from actorlm.bench.throughput import bench_prompts
streams = int(sys.argv[1])
llm = LLM(max_num_seqs=streams)
prompts = [{"prompt_token_ids": llm.engine.apply_chat_template(c)} for c in bench_prompts(3 * streams)]
llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
here = os.path.dirname(os.path.abspath(__file__))
for busy, period in [(0, 0), (2, 20)] * 3:
    p = subprocess.Popen([sys.executable, os.path.join(here, 'cotenant.py'), str(busy), str(period)]) if busy else None
    time.sleep(0.3)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    s = time.perf_counter() - start
    if p: p.kill(); p.wait()
    print(json.dumps({"spincount": os.environ.get("GOMP_SPINCOUNT", "default"), "streams": streams,
                      "busy_ms": busy, "period_ms": period,
                      "tok_s": round(sum(len(o.outputs[0].token_ids) for o in outputs) / s, 1)}), flush=True)
