#!/bin/bash
# before (a3f8161) and after (HEAD) of the same command, alternating, three rounds
cd /tmp
for round in 1 2 3 4; do  # (rounds 3 and 4 ran again after a test run spoiled the first round 3)
  for side in base head; do
    if [ $side = base ]; then dir=/tmp/base-a3f; else dir=/work/main; fi
    (cd $dir && HF_HUB_OFFLINE=1 PYTHONPATH=$dir /work/main/.venv/bin/python -c "import sys; from actorlm.api.cli import main; sys.exit(main())" \
      bench latency --batch-size 16 --input-len 32 --output-len 64 --num-iters 3 --json) \
      > /tmp/hotpath/$side-$round.json 2> /tmp/hotpath/$side-$round.err
  done
done
echo done
