#!/usr/bin/env bash
# Encoder embeddings: a BERT-base-sized model against sentence-transformers, both dtypes.
set -euo pipefail
HF_HUB_OFFLINE=1 .venv/bin/python docs/benchmark-data/encoder-embed-20261207/make_bert.py /tmp/bench/bert-base-st
for dtype in auto float32; do
  HF_HUB_OFFLINE=1 .venv/bin/actorlm bench embed --model /tmp/bench/bert-base-st --num-prompts 256 \
    --input-len 128 --num-iters 3 --compare st --dtype "$dtype" --json | tail -1
done
