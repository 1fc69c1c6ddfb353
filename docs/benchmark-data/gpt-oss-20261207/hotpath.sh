#!/bin/bash
# before (f42630d, the last stop) and after (this stop's head) of the same command, taking
# turns, a warm-up round first (the C++ kernels build on first use), then five rounds; one
# stream and batch 16 on the shipped SmolLM2 GGUF
cd /tmp
for round in warm 1 2 3 4 5; do
  for side in base head; do
    if [ $side = base ]; then dir=/tmp/wt-base; else dir=/work/main; fi
    for batch in 1 16; do
      (cd $dir && HF_HUB_OFFLINE=1 PYTHONPATH=$dir /work/main/.venv/bin/python -c "import sys; from actorlm.api.cli import main; sys.exit(main())" \
        bench latency --batch-size $batch --input-len 32 --output-len 64 --num-iters 3 --json) \
        2>/dev/null | tail -1 > /tmp/hotpath3/$side-b$batch-$round.json
    done
  done
done
echo done
