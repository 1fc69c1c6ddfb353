#!/usr/bin/env bash
# The embedding benchmark: SmolLM2 as a sentence-transformers model, against sentence-transformers.
set -euo pipefail
HF_HUB_OFFLINE=1 .venv/bin/python docs/benchmark-data/embed-20261206-amx/make_st.py /tmp/bench/smollm2-dense /tmp/bench/smollm2-st
for dtype in auto float32; do
  HF_HUB_OFFLINE=1 .venv/bin/actorlm bench embed --model /tmp/bench/smollm2-st --num-prompts 256 \
    --input-len 128 --num-iters 3 --compare st --dtype "$dtype" --json | tail -1
done
