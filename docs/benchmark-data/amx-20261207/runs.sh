#!/bin/bash
# Issues 27 and 28's speed bars on the Intel Xeon with AMX (bf16 the default
# dtype), the commands of the earlier machines' runs, unchanged.
set -x
export HF_HUB_OFFLINE=1
cd "$(dirname "$0")/../../.."
here=docs/benchmark-data/amx-20261207
lscpu | grep -E 'Model name|^Model:|family' > $here/cpu.txt
.venv/bin/python benchmarks/lora_adapters.py -o /tmp/smollm2-lora --num 4 --rank 16
for i in 1 2 3 4 5; do
  .venv/bin/actorlm bench latency --batch-size 1 --output-len 128 --num-iters 15 --enable-lora \
      --lora-path /tmp/smollm2-lora/lora-1 --json > $here/lora-lat-$i.json 2>/dev/null
done
for i in 1 2 3; do
  .venv/bin/actorlm bench throughput --num-prompts 64 --output-len 128 --num-iters 3 \
      --enable-lora --max-loras 4 --lora-path /tmp/smollm2-lora/lora-1 /tmp/smollm2-lora/lora-2 \
      /tmp/smollm2-lora/lora-3 /tmp/smollm2-lora/lora-4 --json > $here/lora-tp-$i.json 2>/dev/null
done
.venv/bin/python benchmarks/server_share.py --streams 1 16 --rounds 3 > $here/server-share.jsonl
