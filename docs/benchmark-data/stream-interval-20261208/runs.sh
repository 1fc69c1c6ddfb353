#!/bin/bash
# Issue 27's 16-stream server share with --stream-interval 1 (the default) and 8, one after
# the other (the default model at the default dtype, bf16 on this CPU).
export HF_HUB_OFFLINE=1
cd "$(dirname "$0")/../../.."
here=docs/benchmark-data/stream-interval-20261208
for si in 1 8; do
  .venv/bin/python benchmarks/server_share.py --streams 16 --rounds 3 -- --stream-interval $si \
      > $here/share-si$si.jsonl
done
