cd /tmp/hops
for round in 3 4 5 6; do
  for side in new base; do
    dir=$([ $side = base ] && echo /tmp/hops/base || echo /work/main)
    echo "## $side round $round, 1 stream"
    (cd $dir && PYTHONPATH=$dir HF_HUB_OFFLINE=1 timeout 300 /work/main/.venv/bin/python /tmp/hops/thread_cpu.py 1 8 | grep -E "tok/s|by pid")
  done
done
