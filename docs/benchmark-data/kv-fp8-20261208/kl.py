import sys, time, torch
sys.path[:0] = ["tests/models", "tests"]
from paged_contexts import PagedContexts
from quantized_oracle import mean_kl
from test_gguf_files_in_the_wild import TEXT
from actorlm.kernels import select_backend
from actorlm.models.loader import load_model, resolve_model
from transformers import AutoTokenizer
path = resolve_model(None)
ids = AutoTokenizer.from_pretrained(path)((TEXT + "\n") * 7).input_ids[:1040]
for dtype in (torch.float32, torch.bfloat16):
    model = load_model(path, dtype, "cpu", select_backend("cpu"))
    runs = {}
    for cache in (None, torch.float8_e4m3fn, torch.float8_e5m2):
        c = PagedContexts(model, num_blocks=300, block_size=16, cache_dtype=cache)
        t0 = time.time()
        logits = [c.step(model, [(0, ids[:16])])] + [c.step(model, [(0, [t])]) for t in ids[16:]]
        runs[str(cache)] = torch.cat(logits).float()
    ref = runs["None"]
    for k, v in runs.items():
        agree = (v.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(dtype, k, "KL vs model-dtype cache %.5f" % mean_kl(ref, v), "argmax agreement %.4f" % agree)
