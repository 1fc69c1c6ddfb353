#!/bin/bash
# A/B of the Q5_0 interleaving (acf7bcf before, 077586c after), one stream, taking turns
# (/tmp/wt-before: a worktree of acf7bcf)
cd /work/main
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2
M=/tmp/actorlm-gpt-oss-shapes/gpt-oss-20b-shapes-4-layers
for round in 1 2 3; do
  for tree in after before; do
    if [ $tree = before ]; then export PYTHONPATH=/tmp/wt-before; else unset PYTHONPATH; fi
    .venv/bin/python -m actorlm.api.cli bench latency --model $M --dtype bfloat16 --max-model-len 1024 --batch-size 1 --input-len 128 --output-len 64 --json 2>/dev/null | tail -1 | sed "s/^{/{\"ab\": \"$tree\", /"
  done
done
