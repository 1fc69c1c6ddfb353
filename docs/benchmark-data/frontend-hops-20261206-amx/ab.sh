# Thread CPU a token, the code before (a worktree of HEAD at /tmp/hops/base) and after
# (/work/main), taking turns, with the LoRA section's thread_cpu.py.
# usage: bash ab.sh STREAMS REQUESTS_PER_STREAM "ROUNDS" "SIDES, IN TURN ORDER"
#   thread-cpu-ab-rounds1-2.txt: bash ab.sh 1 8 "1 2" "base new"; bash ab.sh 16 3 1 "base new"
#   thread-cpu-ab-rounds3-6.txt: bash ab.sh 1 8 "3 4 5 6" "new base"
script=/work/main/docs/benchmark-data/lora-server-share-20261205-amx/thread_cpu.py
for round in $3; do
  for side in $4; do
    dir=$([ $side = base ] && echo /tmp/hops/base || echo /work/main)
    echo "## $side round $round, $1 stream(s)"
    (cd $dir && PYTHONPATH=$dir HF_HUB_OFFLINE=1 timeout 300 /work/main/.venv/bin/python $script $1 $2 \
      | grep -E "tok/s|client|by pid")
  done
done
