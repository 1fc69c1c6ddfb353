#!/bin/bash
# The shipped GGUF (SmolLM2, Q4_1 + Q8_0) run in its blocks against the same weights dequantized
# by transformers and run in bf16, taking turns in one run; data under docs/benchmark-data/.
#   bash benchmarks/gguf_blocks.sh [DENSE_DIR]   (the dequantized copy is written there once)
# With LLAMA_CPP_PYTHON set to a python that has llama-cpp-python, llama.cpp's one stream on the
# same file takes its turns too (benchmarks/llama_cpp_peer.py).
set -e
cd "$(dirname "$0")/.."; export HF_HUB_OFFLINE=1
DENSE=${1:-/tmp/smol_dense}
test -f $DENSE/model.safetensors || .venv/bin/python -c "
import pathlib, sys
from actorlm.models.gguf_file import write_dense_copy
from actorlm.models.loader import default_gguf_path
write_dense_copy(default_gguf_path(), pathlib.Path(sys.argv[1]))" $DENSE
GGUF=$(.venv/bin/python -c "from actorlm.models.loader import default_gguf_path; print(default_gguf_path())")
OUT=docs/benchmark-data/gguf-blocks-$(date +%Y%m%d-%H%M)
mkdir -p $OUT; lscpu > $OUT/lscpu.txt
for i in 1 2 3; do
  .venv/bin/actorlm bench latency --json 2>/dev/null | tail -1 >> $OUT/latency-gguf.jsonl
  .venv/bin/actorlm bench latency --model $DENSE --dtype bfloat16 --json 2>/dev/null | tail -1 >> $OUT/latency-bf16.jsonl
  if [ -n "$LLAMA_CPP_PYTHON" ]; then
    $LLAMA_CPP_PYTHON benchmarks/llama_cpp_peer.py "$GGUF" >> $OUT/latency-llama-cpp.jsonl
  fi
done
for i in 1 2 3; do
  .venv/bin/actorlm bench throughput --num-prompts 64 --output-len 128 --json 2>/dev/null | tail -1 >> $OUT/throughput-gguf.jsonl
  .venv/bin/actorlm bench throughput --model $DENSE --dtype bfloat16 --num-prompts 64 --output-len 128 --json 2>/dev/null | tail -1 >> $OUT/throughput-bf16.jsonl
done
for m in none "$DENSE"; do
  .venv/bin/python - "$m" >> $OUT/memory.jsonl 2>/dev/null <<'PY'
import sys, json
from actorlm import LLM
model = None if sys.argv[1] == "none" else sys.argv[1]
llm = LLM(model, dtype="bfloat16", num_kv_blocks=64, max_model_len=1024)
rss = int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
print(json.dumps({"model": sys.argv[1], "rss_mib_after_load": rss}))
PY
done
.venv/bin/python - >> $OUT/bandwidth.json <<'PY'
import torch, time, json, statistics
x = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB
x.sum()
times = []
for _ in range(5):
    t = time.perf_counter(); x.sum(); times.append(time.perf_counter() - t)
print(json.dumps({"sum_GBps": round(x.numel() * 4 / statistics.median(times) / 1e9, 1), "threads": torch.get_num_threads()}))
PY
echo done
