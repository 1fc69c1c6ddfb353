#!/bin/bash
# before (a7c17ae: the LayerNorm families' layers in torch ops) and after (the one-call step
# takes them), taking turns, three rounds; SmolLM2's GGUF as the hot path's own check
cd /tmp/lnbench
PY=/work/main/.venv/bin/python
for round in 1 2 3; do
  for model in /tmp/lnbench/models/phi /tmp/lnbench/models/starcoder2 /tmp/lnbench/models/cohere /tmp/lnbench/models/llama default; do
    for tree in before after; do
      root=/work/main; [ $tree = before ] && root=/tmp/wt_before
      flag="--model $model"; [ $model = default ] && flag=""
      out=$(cd $root && HF_HUB_OFFLINE=1 PYTHONPATH=$root $PY -m actorlm.api.cli bench latency $flag \
            --dtype bfloat16 --batch-size 1 --input-len 32 --output-len 128 --num-iters 5 --json 2>>run.err | tail -1)
      echo "{\"round\": $round, \"model\": \"$model\", \"tree\": \"$tree\", \"result\": $out}" >> results.jsonl
    done
  done
done
