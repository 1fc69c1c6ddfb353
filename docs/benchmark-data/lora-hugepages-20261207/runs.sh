#!/bin/bash
# LoRA slot tables in 4 KiB pages (before) and in huge pages (after), taking turns: issue 28's
# one-stream bar, the command of the earlier runs. $1, $2: the two versions of
# actorlm/models/lora_slots.py.
set -x
export HF_HUB_OFFLINE=1
cd "$(dirname "$0")/../../.."
here=docs/benchmark-data/lora-hugepages-20261207
lscpu | grep -E 'Model name|^Model:|family' > $here/cpu.txt
for i in 1 2 3 4 5; do
  for side in before after; do
    if [ $side = before ]; then cp "$1" actorlm/models/lora_slots.py; else cp "$2" actorlm/models/lora_slots.py; fi
    .venv/bin/actorlm bench latency --batch-size 1 --output-len 128 --num-iters 15 --enable-lora \
        --lora-path /tmp/smollm2-lora/lora-1 --json > $here/$side-$i.json 2>/dev/null
  done
done
cp "$2" actorlm/models/lora_slots.py
