"""One command for a CUDA machine: kernel correctness on the GPU, kernel timings, and throughput.

    python benchmarks/gpu_check.py [--quick]

Prints one JSON object on the last line. Sections that fail record their error instead of
aborting the rest. Budget: well under 8 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")  # compiled kernels, not the interpreter
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, iters: int = 50) -> float:
    """Median milliseconds per call, measured with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def decode_batch(num_seqs, context, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """A decode step over ``num_seqs`` requests of ``context`` cached tokens each."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    dev = "cuda"
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks, device=dev, dtype=torch.int32).view(num_seqs, blocks_per_seq)
    query = torch.randn(num_seqs, num_heads, head_dim, device=dev, dtype=dtype)
    qsl = torch.arange(num_seqs + 1, device=dev, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), context, device=dev, dtype=torch.int32)
    return query, k_cache, v_cache, table, qsl, seq_lens


def check_attention(results: dict) -> None:
    from actorlm.kernels.triton.paged_attention import paged_attention
    from actorlm.kernels.reference import paged_attention_ref

    rows = []
    for num_seqs, context in [(64, 512), (256, 1024), (32, 4096)]:
        heads, kv_heads, head_dim, bs, dtype = 32, 8, 128, 16, torch.bfloat16
        q, kc, vc, table, qsl, lens = decode_batch(num_seqs, context, heads, kv_heads, head_dim,
                                                   bs, dtype)
        scale = head_dim ** -0.5
        kwargs = dict(max_query_len=1, max_seq_len=context)
        out = paged_attention(q, kc, vc, table, qsl, lens, scale, **kwargs)
        ref = paged_attention_ref(q, kc, vc, table, qsl, lens, scale)  # the oracle, float64
        cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.float().flatten(), 0)

        def sdpa():
            k = kc[table.long()].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D] gathered
            v = vc[table.long()].flatten(1, 2).transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(
                q[:, :, None], k, v, scale=scale, enable_gqa=True)

        t_triton = timed(lambda: paged_attention(q, kc, vc, table, qsl, lens, scale, **kwargs))
        t_sdpa = timed(sdpa, 20)
        kv_bytes = 2 * num_seqs * context * kv_heads * head_dim * kc.element_size()
        rows.append({"num_seqs": num_seqs, "context": context, "max_abs_diff":
                     float((out.float() - ref.float()).abs().max()), "cosine": float(cos),
                     "triton_ms": round(t_triton, 4),
                     "sdpa_gathered_ms": round(t_sdpa, 4),
                     "triton_decode_gb_per_s": round(kv_bytes / t_triton / 1e6, 1)})
    results["decode_attention"] = rows


def check_sampling(results: dict) -> None:
    from actorlm.kernels.cpu.sampler import sample as sample_torch
    from actorlm.kernels.triton.sampling import sample

    batch, vocab = 256, 128256
    logits = torch.randn(batch, vocab, device="cuda") * 3
    args = (torch.full((batch,), 0.8, device="cuda"), torch.full((batch,), 50, device="cuda",
            dtype=torch.int32), torch.full((batch,), 0.9, device="cuda"),
            torch.zeros(batch, device="cuda"), torch.arange(batch, device="cuda"),
            torch.zeros(batch, device="cuda", dtype=torch.int64))
    greedy = sample(logits, torch.zeros(batch, device="cuda"), *args[1:])
    results["sampling"] = {
        "greedy_equals_argmax": bool((greedy == logits.argmax(-1)).all()),
        "triton_ms": round(timed(lambda: sample(logits, *args)), 4),
        "torch_sampler_ms": round(timed(lambda: sample_torch(logits, *args), 10), 4),
    }


def run_kernel_tests(results: dict) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "ACTORLM_TEST_DEVICE": "cuda"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests/kernels"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    results["kernel_tests"] = {"returncode": proc.returncode,
                               "summary": (proc.stdout.strip().splitlines() or [""])[-1]}


def kv_sizing() -> dict:
    """The engine on the default model with default flags: the KV pool is sized by profiling
    (``actorlm.models.memory_profile``). Run in a process of its own (``--kv-sizing``), so that it
    takes the GPU as a user's engine would and gives it all back."""
    from actorlm import LLM, SamplingParams
    from actorlm.models.parts import model_geometry

    gib = 1 << 30
    start = time.perf_counter()
    with LLM() as llm:
        engine, config = llm.engine, llm.config
        profile = engine.memory_profile
        free, total = torch.cuda.mem_get_info()
        layers, kv_heads, head_dim = model_geometry(engine.hf_config)
        bytes_per_block = 2 * layers * config.block_size * kv_heads * head_dim * \
            torch.empty((), dtype=engine.dtype).element_size()
        ready_s = time.perf_counter() - start
        # a full batch of long prompts: the pool and the activations must both fit
        prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(1000)]}
                   for i in range(config.max_num_seqs)]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9,
                                                       logprobs=5, ignore_eos=True),
                               use_tqdm=False)
        return {
            "model": engine.model_path.name, "dtype": str(engine.dtype),
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_num_seqs": config.max_num_seqs, "max_model_len": config.max_model_len,
            "num_kv_blocks": config.num_kv_blocks, "block_size": config.block_size,
            "kv_cache_gib": round(config.num_kv_blocks * bytes_per_block / gib, 3),
            "total_gib": round(profile.total_bytes / gib, 3) if profile else None,
            "used_after_load_gib": round(profile.used_bytes / gib, 3) if profile else None,
            "peak_activation_gib": round(profile.peak_activation_bytes / gib, 3)
            if profile else None,
            "in_use_when_ready_gib": round((total - free) / gib, 3),
            "share_in_use_when_ready": round((total - free) / total, 4),
            "peak_in_use_after_generate_gib": round(torch.cuda.max_memory_reserved() / gib, 3),
            "engine_ready_s": round(ready_s, 1),
            "generated_ok": all(len(o.outputs[0].token_ids) == 32 for o in outputs),
        }


def run_kv_sizing(results: dict) -> None:
    proc = subprocess.run([sys.executable, __file__, "--kv-sizing"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    last = (proc.stdout.strip().splitlines() or ["{}"])[-1]
    results["kv_sizing"] = json.loads(last) if proc.returncode == 0 else {
        "returncode": proc.returncode, "stderr_tail": proc.stderr[-2000:]}


def run_throughput(results: dict, quick: bool) -> None:
    cmd = [sys.executable, "-m", "actorlm.api.cli", "bench", "throughput", "--num-prompts",
           "64" if quick else "256", "--output-len", "128", "--dtype", "bfloat16", "--json"]
    env = {**os.environ, "ACTORLM_ATTENTION_BACKEND": "triton"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    last = (proc.stdout.strip().splitlines() or ["{}"])[-1]
    results["throughput_triton"] = json.loads(last) if proc.returncode == 0 else {
        "returncode": proc.returncode, "stderr_tail": proc.stderr[-2000:]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--kv-sizing", action="store_true", help="only the KV sizing check")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    if args.kv_sizing:
        print(json.dumps(kv_sizing()))
        return 0
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    start = time.perf_counter()
    for name, section in [("kernel_tests", run_kernel_tests), ("kv_sizing", run_kv_sizing),
                          ("attention", check_attention),
                          ("sampling", check_sampling),
                          ("throughput", lambda r: run_throughput(r, args.quick))]:
        try:
            section(results)
        except Exception as exc:  # noqa: BLE001 — one failing section must not hide the others
            results[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
    results["elapsed_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
