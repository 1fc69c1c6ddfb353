#!/bin/bash
# issue 28 speed bars on HEAD, this machine
set -x
export HF_HUB_OFFLINE=1
cd /work/main
lscpu | grep -E 'Model name|^Model:|family' 
.venv/bin/python benchmarks/lora_adapters.py -o /tmp/smollm2-lora --num 4 --rank 16
for i in 1 2 3 4 5; do
  .venv/bin/actorlm bench latency --batch-size 1 --output-len 128 --num-iters 15 --enable-lora --lora-path /tmp/smollm2-lora/lora-1 --json > /tmp/r28/lat-$i.json 2>/tmp/r28/lat-$i.err
  tail -1 /tmp/r28/lat-$i.json
done
for i in 1 2 3; do
  .venv/bin/actorlm bench throughput --num-prompts 64 --output-len 128 --num-iters 3 --enable-lora --max-loras 4 --lora-path /tmp/smollm2-lora/lora-1 /tmp/smollm2-lora/lora-2 /tmp/smollm2-lora/lora-3 /tmp/smollm2-lora/lora-4 --json > /tmp/r28/tp-$i.json 2>/tmp/r28/tp-$i.err
  tail -1 /tmp/r28/tp-$i.json
done
