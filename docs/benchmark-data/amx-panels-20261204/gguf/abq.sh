#!/bin/bash
# A/B of the dequantized panels on AMX tiles (the shipped Q4_1 GGUF, --dtype auto = bf16):
# before = /tmp/before2 (git worktree add /tmp/before2 7c9dcf6), after = the checkout
OUT=/tmp/amx/abq; mkdir -p $OUT; cd /tmp
export HF_HUB_OFFLINE=1
B=/work/main/.venv/bin/python
run() { local v=$1; shift; if [ $v = before ]; then PYTHONPATH=/tmp/before2 $B -m actorlm.api.cli "$@"; else $B -m actorlm.api.cli "$@"; fi; }
for round in 1 2 3; do
  for v in before after; do
    run $v bench latency --batch-size 1 --input-len 256 --output-len 16 --num-iters 3 --json 2>/dev/null | tail -1 >> $OUT/prefill256-$v.jsonl
    run $v bench latency --batch-size 1 --input-len 64 --output-len 16 --num-iters 3 --json 2>/dev/null | tail -1 >> $OUT/prefill64-$v.jsonl
    run $v bench throughput --num-prompts 64 --output-len 128 --json 2>/dev/null | tail -1 >> $OUT/gguf64-$v.jsonl
  done
done
