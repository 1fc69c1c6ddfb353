# Per-thread CPU of a served run (../lora-server-share-20261205-amx/thread_cpu.py, 16 streams x 3 requests x 128 tokens), with
# uvloop installed and without, taking turns; run from a checkout of the commit measured.
for round in 1 2; do
  .venv/bin/python docs/benchmark-data/lora-server-share-20261205-amx/thread_cpu.py 16 3 | grep -E "tok/s|by pid|client" > t-with-$round.txt
  .venv/bin/pip uninstall -y uvloop
  .venv/bin/python docs/benchmark-data/lora-server-share-20261205-amx/thread_cpu.py 16 3 | grep -E "tok/s|by pid|client" > t-without-$round.txt
  .venv/bin/pip install uvloop
done
