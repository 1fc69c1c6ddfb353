#!/bin/bash
# three rounds, taking turns: the shipped GGUF (Q4_1), SmolLM2 quantized by GPTQ's layout (4-bit symmetric, groups of 64), the same weights dense in bf16
cd /work/main
for round in 1 2 3; do
  for m in gguf gptq dense; do
    case $m in gguf) arg="";; gptq) arg="--model /tmp/smol-gptq/quantized";; dense) arg="--model /tmp/smollm2-dense";; esac
    HF_HUB_OFFLINE=1 .venv/bin/actorlm bench latency $arg --batch-size 1 --output-len 128 --num-iters 5 --json > /tmp/pqbench/latency-$m-$round.json 2>/tmp/pqbench/err-$m-$round.log
    HF_HUB_OFFLINE=1 .venv/bin/actorlm bench throughput $arg --num-prompts 64 --output-len 128 --json > /tmp/pqbench/throughput-$m-$round.json 2>>/tmp/pqbench/err-$m-$round.log
  done
done
