#!/bin/bash
# taking turns: the code of 379b0a6 (a worktree at /tmp/base) and of 0c5d7cc, the same venv
cd /work/main
for round in 1 2 3; do
  for side in base head; do
    dir=/work/main; [ $side = base ] && dir=/tmp/base
    (cd $dir && HF_HUB_OFFLINE=1 PYTHONPATH=$dir /work/main/.venv/bin/python -m actorlm.api.cli bench latency \
      --batch-size 16 --input-len 32 --output-len 64 --num-iters 5 --json 2>/dev/null | tail -1 > /tmp/ab-$side-$round.json)
    echo "$side $round $(python3 -c "import json;d=json.load(open('/tmp/ab-$side-$round.json'));print({k:v for k,v in d.items() if 'tpot' in k.lower() or 'latency' in k.lower()})")"
  done
done
