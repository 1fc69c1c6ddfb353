#!/bin/sh
# Three rounds taking turns: the dense weights, FP8 per channel / per token, FP8 blocks (the
# fp8 method). Run from the repository root after make_checkpoints.py.
D=docs/benchmark-data/fp8-20261206-amx
for round in 1 2 3; do
  for name in dense fp8-channel fp8-method; do
    model=/tmp/smollm2-dense; [ $name != dense ] && model=/tmp/smol-$name
    .venv/bin/actorlm bench latency --model $model --batch-size 1 --output-len 128 \
        --num-iters 5 --json > $D/latency-$name-$round.json 2>/dev/null
    .venv/bin/actorlm bench throughput --model $model --num-prompts 64 --output-len 128 \
        --json > $D/throughput-$name-$round.json 2>/dev/null
  done
done
