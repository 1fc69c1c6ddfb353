#!/usr/bin/env bash
# actorlm (with sentence-transformers beside it) and vLLM's CPU wheel (0.32.0, in
# /tmp/vllm-venv) on the same 256 prompts, one after the other, both dtypes.
set -euo pipefail
D=docs/benchmark-data/encoder-embed-20261207
mkdir -p /tmp/peer
HF_HUB_OFFLINE=1 .venv/bin/python -c "
import json
from transformers import AutoTokenizer
from actorlm.bench.embed import embed_texts
json.dump(embed_texts(AutoTokenizer.from_pretrained('/tmp/bench/bert-base-st'), 256, 128),
          open('/tmp/peer/texts.json', 'w'))"
for dtype in bfloat16 float32; do
  HF_HUB_OFFLINE=1 .venv/bin/actorlm bench embed --model /tmp/bench/bert-base-st --num-prompts 256 \
    --input-len 128 --num-iters 3 --compare st --dtype "$dtype" --json 2>/dev/null | tail -1 >> $D/peer.jsonl
  (cd /tmp/peer && HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 /tmp/vllm-venv/bin/python \
    /work/main/$D/vllm_embed.py /tmp/bench/bert-base-st "$dtype" 2>/dev/null | grep '^{') >> $D/peer.jsonl
done
