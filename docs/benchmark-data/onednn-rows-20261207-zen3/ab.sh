#!/bin/bash
# Before/after of rounding fp32 rows for oneDNN up to a multiple of 8, in turns, three rounds:
# run with the change uncommitted in the work tree ("before" stashes it). DENSE: SmolLM2's GGUF
# dequantized to fp32 safetensors (actorlm.models.gguf_file.write_dense_copy).
cd "$(git rev-parse --show-toplevel)"
for round in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then git stash -q; fi
    for seqs in 20 64; do
      out=$(HF_HUB_OFFLINE=1 .venv/bin/actorlm bench throughput --model "${DENSE:-/tmp/smollm2-dense}" --num-prompts 64 --output-len 64 --max-num-seqs $seqs --num-iters 1 2>/dev/null | grep -E "output_tokens_per_s" | tr -s " ")
      echo "$round $side seqs=$seqs $out"
    done
    if [ $side = before ]; then git stash pop -q; fi
  done
done
