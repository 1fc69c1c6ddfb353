cd /tmp
for tree in /tmp/ab-base /work/main /tmp/ab-base /work/main; do
  PYTHONPATH=$tree HF_HUB_OFFLINE=1 /work/main/.venv/bin/actorlm bench throughput --num-prompts 64 --output-len 128 --num-iters 1 --enable-lora --max-loras 4 --lora-path /tmp/smollm2-lora/lora-{1,2,3,4} --json 2>/dev/null | tail -1 | python3 -c "import json,sys;d=json.load(sys.stdin);print('$tree', {k:v for k,v in d.items() if 'tok' in k or 'ratio' in k})"
done
for i in 1 2 3; do
  HF_HUB_OFFLINE=1 /work/main/.venv/bin/actorlm bench latency --model /tmp/smollm2-dense --batch-size 1 --output-len 128 --num-iters 15 --enable-lora --lora-path /tmp/smollm2-lora/lora-1 --json 2>/dev/null | tail -1 > /tmp/lora_mb/dense-latency-$i.json
  python3 -c "import json;d=json.load(open('/tmp/lora_mb/dense-latency-$i.json'));print('dense', d['dtype'], d['tpot_ms'], d['lora_tpot_ms'], d['decode_ratio_lora_vs_base'])"
done
for i in 1 2 3; do
  HF_HUB_OFFLINE=1 /work/main/.venv/bin/actorlm bench latency --batch-size 1 --output-len 128 --num-iters 15 --enable-lora --lora-path /tmp/smollm2-lora/lora-1 --json 2>/dev/null | tail -1 > /tmp/lora_mb/gguf-latency-$i.json
  python3 -c "import json;d=json.load(open('/tmp/lora_mb/gguf-latency-$i.json'));print('gguf', d['dtype'], d['tpot_ms'], d['lora_tpot_ms'], d['decode_ratio_lora_vs_base'])"
done
