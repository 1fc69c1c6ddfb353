#!/bin/bash
# --kv-cache-dtype fp8 / fp8_e5m2 against auto (bf16 here) on the default model, taking turns,
# three rounds; then the hot path (auto) before the change (630a4b6, a worktree at $BEFORE)
# and after it, taking turns.
export HF_HUB_OFFLINE=1
cd "$(dirname "$0")/../../.."
here=docs/benchmark-data/kv-fp8-20261208
BEFORE=${BEFORE:-/tmp/wt-before}
lscpu | grep -E 'Model name|^Model:|family' > $here/cpu.txt
for round in 1 2 3; do
  for kv in auto fp8 fp8_e5m2; do
    for bs in 1 16; do
      .venv/bin/actorlm bench latency --batch-size $bs --input-len 512 --output-len 64 \
          --num-iters 3 --kv-cache-dtype $kv --json > $here/lat-$kv-bs$bs-$round.json 2>/dev/null
    done
  done
done
for round in 1 2 3; do
  for side in before after; do
    root=$([ $side = before ] && echo $BEFORE || echo .)
    for bs in 1 16; do
      (cd $root && PYTHONPATH=. /work/main/.venv/bin/python -m actorlm.api.cli bench latency \
          --batch-size $bs --output-len 128 --num-iters 5 --json) \
          > $here/hot-$side-bs$bs-$round.json 2>/dev/null
    done
  done
done
