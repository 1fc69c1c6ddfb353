#!/bin/bash
# before (no panel GEMM: MKL/oneDNN) and after (AVX2 panel GEMM), taking turns
cd /work/main
export HF_HUB_OFFLINE=1
OUT=/tmp/avx2_bench; mkdir -p $OUT
NOPANEL="import sys, actorlm.kernels.cpu.linear as l; l._kernel = lambda dtype=None: None; from actorlm.api.cli import main; sys.argv[0]='actorlm'; sys.exit(main())"
PANEL="import sys; from actorlm.api.cli import main; sys.argv[0]='actorlm'; sys.exit(main())"
for round in 1 2 3; do
  for variant in before after; do
    code=$([ $variant = before ] && echo "$NOPANEL" || echo "$PANEL")
    .venv/bin/python -c "$code" bench latency --model /tmp/smollm2-dense --batch-size 1 --json 2>/dev/null | tail -1 >> $OUT/smollm2-$variant.jsonl
    .venv/bin/python -c "$code" bench latency --model /tmp/actorlm-moe-vs-dense-49k/qwen3-moe --batch-size 1 --json 2>/dev/null | tail -1 >> $OUT/moe-$variant.jsonl
  done
done
