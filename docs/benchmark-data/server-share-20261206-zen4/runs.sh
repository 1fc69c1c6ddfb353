#!/bin/bash
# The runs behind docs/benchmarks.md's "The engine on a core of its own" (2026-12-06), in order.
set -x
export HF_HUB_OFFLINE=1
cd "$(dirname "$0")/../../.."
here=docs/benchmark-data/server-share-20261206-zen4
# libgomp's spin before a waiting thread sleeps, alone and beside a 0.1-core neighbour
for sc in default 20000 3000000 infinite; do
  if [ $sc = default ]; then unset GOMP_SPINCOUNT; else export GOMP_SPINCOUNT=$sc; fi
  .venv/bin/python $here/spin_offline.py 1
done > $here/spincount.jsonl
unset GOMP_SPINCOUNT
.venv/bin/python benchmarks/server_share.py --streams 1 16 --rounds 3 > $here/auto.jsonl
.venv/bin/python benchmarks/server_share.py --streams 1 16 --rounds 3 --engine-cpus 0 > $here/pinned.jsonl
.venv/bin/python benchmarks/server_share.py --streams 1 16 --rounds 3 --engine-cpus 0 --dtype float32 > $here/pinned-fp32.jsonl
.venv/bin/python benchmarks/server_share.py --streams 1 --requests-per-stream 8 --rounds 5 --engine-cpus 0 > $here/pinned-1x8.jsonl
.venv/bin/python benchmarks/server_share.py --streams 1 --requests-per-stream 8 --rounds 5 > $here/shared-1x8.jsonl
.venv/bin/python benchmarks/server_share.py --streams 1 --requests-per-stream 8 --rounds 5 --engine-cpus 0 --dtype float32 > $here/pinned-fp32-1x8.jsonl
