#!/bin/bash
# A/B of the bf16 panels on AMX tiles, before and after taking turns in the same hour.
# before: git worktree add /tmp/before 6485cd2 (imported from /tmp/before: run from /tmp, so
# that the working directory does not shadow it); after: the checkout (the venv's editable
# install). /tmp/smollm2-dense: the shipped GGUF's weights dequantized by transformers and
# saved in bf16; the MoE: benchmarks/moe_vs_dense.py's checkpoint.
OUT=/tmp/amx/ab; mkdir -p $OUT; cd /tmp
export HF_HUB_OFFLINE=1
B=/work/main/.venv/bin/python
run() {  # variant name, args...
  local v=$1; shift
  if [ $v = before ]; then PYTHONPATH=/tmp/before $B -m actorlm.api.cli "$@"; else $B -m actorlm.api.cli "$@"; fi
}
for round in 1 2 3; do
  for v in before after; do
    run $v bench throughput --model /tmp/smollm2-dense --dtype bfloat16 --num-prompts 16 --output-len 128 --json 2>/dev/null | tail -1 >> $OUT/dense16-$v.jsonl
    run $v bench throughput --model /tmp/smollm2-dense --dtype bfloat16 --num-prompts 64 --output-len 128 --json 2>/dev/null | tail -1 >> $OUT/dense64-$v.jsonl
    run $v bench latency --model /tmp/smollm2-dense --dtype bfloat16 --batch-size 1 --output-len 128 --num-iters 3 --json 2>/dev/null | tail -1 >> $OUT/dense1-$v.jsonl
    run $v bench throughput --model /tmp/actorlm-moe-vs-dense-49k/qwen3-moe --dtype bfloat16 --num-prompts 64 --output-len 128 --json 2>/dev/null | tail -1 >> $OUT/moe64-$v.jsonl
  done
done
