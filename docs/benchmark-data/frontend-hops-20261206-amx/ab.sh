# thread CPU a token, the code before (a worktree of HEAD) and after, taking turns
cd /tmp/hops
for round in 1 2; do
  for side in base new; do
    dir=$([ $side = base ] && echo /tmp/hops/base || echo /work/main)
    echo "## $side round $round, 1 stream"
    (cd $dir && PYTHONPATH=$dir HF_HUB_OFFLINE=1 timeout 300 /work/main/.venv/bin/python /tmp/hops/thread_cpu.py 1 8 | grep -E "tok/s|client|by pid")
  done
done
for side in base new; do
  dir=$([ $side = base ] && echo /tmp/hops/base || echo /work/main)
  echo "## $side, 16 streams"
  (cd $dir && PYTHONPATH=$dir HF_HUB_OFFLINE=1 timeout 300 /work/main/.venv/bin/python /tmp/hops/thread_cpu.py 16 3 | grep -E "tok/s|client|by pid")
done
