# bench latency on the code before the family changes (26fb1a4, worktree /tmp/wt-base) and after
# (88ea9ad, /tmp/wt-head), taking turns; the shipped SmolLM2 GGUF, bf16. Rounds 1-3 ran batch 1
# and 16, rounds 4-13 batch 1 only (head first).
for round in 1 2 3; do
  for side in base head; do
    for bs in 1 16; do
      r=$(cd /tmp/wt-$side && PYTHONPATH=/tmp/wt-$side HF_HUB_OFFLINE=1 .venv/bin/actorlm bench latency \
          --batch-size $bs --output-len 128 --num-iters 15 2>/dev/null | grep -E "tpot_ms|decode_tokens_per_s" | tr -s ' ' | tr '\n' ' ')
      echo "round $round $side bs=$bs $r"
    done
  done
done
