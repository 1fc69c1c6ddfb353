"""``actorlm bench latency``: one batch of ``batch_size`` identical-length requests, timed.

Like ``vllm bench latency``, but it also splits the time: the engine streams every request, so
the time to the first token (the prefill) and the time per output token (a decode step) are
measured apart. Every request decodes exactly ``output_len`` tokens (greedy, EOS ignored).
``--compare hf`` runs transformers' ``generate`` on the same prompt ids in the same process,
taking turns with the engine run by run (ratios are medians of each pair's): its TTFT is a
one-token ``generate``, its decode rate the rest of a full one. ``--profile`` adds the engine's
per-step breakdown (see ``actorlm.trace.step_breakdown``). With ``--lora-path``
(``bench.lora``) each run is followed by the same batch spread over LoRA adapters, and
``decode_ratio_lora_vs_base`` is the median of those pairs' decode-time ratios.
"""

from __future__ import annotations

import functools
import itertools
import queue
import statistics
import time

import torch

from actorlm.bench.lora import lora_fields, spread
from actorlm.bench.throughput import bench_prompts, conversation_ids, profiled, step_breakdown
from actorlm.lora_request import LoRARequest
from actorlm.openmp import on_passing_thread
from actorlm.sampling_params import SamplingParams


def latency_prompts(tokenize, batch_size: int, input_len: int) -> list[list[int]]:
    """``batch_size`` distinct prompts of exactly ``input_len`` tokens: prompt i is chat prompts
    i, i + batch_size, ... run together, cut to length."""
    conversations = bench_prompts(4 * batch_size)
    prompts = []
    for i in range(batch_size):
        ids: list[int] = []
        for j in itertools.count(i, batch_size):
            if len(ids) >= input_len:
                break
            if j >= len(conversations):
                conversations = bench_prompts(2 * j)
            ids += tokenize(conversations[j])
        prompts.append(ids[:input_len])
    return prompts


def grounded_prompts(llm, batch_size: int, input_len: int) -> list[list[int]]:
    """Input-grounded prompts (the work prompt lookup speeds up): chat prompt i's conversation
    continued with the model's own greedy answer of up to ``input_len`` tokens, then the user's
    "Repeat your answer exactly." — a reply that quotes a passage of its context, as an edit, a
    summary that quotes or a retrieval answer does. The passage is the model's own prose: a
    passage it does not understand as quotable text (a list of instructions, say) makes a small
    model follow it rather than repeat it, which measures the model, not the speculation."""
    conversations = bench_prompts(batch_size)
    answers = llm.generate([{"prompt_token_ids": conversation_ids(llm, c)} for c in conversations],
                           SamplingParams(max_tokens=input_len, temperature=0), use_tqdm=False)
    return [conversation_ids(llm, [*c, {"role": "assistant", "content": a.outputs[0].text},
                                   {"role": "user", "content": "Repeat your answer exactly."}])
            for c, a in zip(conversations, answers)]


def run_latency(model: str | None, flags: dict, batch_size: int, input_len: int,
                output_len: int, num_iters: int = 3, compare_hf: bool = False,
                profile: bool = False, workload: str = "free",
                loras: list[LoRARequest] | None = None) -> dict:
    """``workload``: free (chat prompts cut to ``input_len`` tokens) or grounded (requests to
    repeat an answer of up to ``input_len`` tokens, see ``grounded_prompts``)."""
    from actorlm.llm import LLM

    if output_len < 2:
        raise ValueError(f"--output-len must be at least 2 (a prefill and a decode), "
                         f"got {output_len}")
    if min(batch_size, input_len, num_iters) < 1:
        raise ValueError("--batch-size, --input-len and --num-iters must be at least 1")
    with profiled(profile) as trace_file:
        llm = LLM(model, trace_file=trace_file, **flags)
        try:
            prompts = grounded_prompts(llm, batch_size, input_len) if workload == "grounded" \
                else latency_prompts(functools.partial(conversation_ids, llm), batch_size,
                                     input_len)
            for lora in [None, *(loras or ())]:  # warm-up: allocations, threads, adapters
                _timed_batch(llm, prompts[:1], 4, [lora])
            path, dtype = llm.engine.model_path, llm.engine.dtype
            hf_run = on_passing_thread(_hf_runner, path, dtype, prompts, output_len) \
                if compare_hf else None
            since, before = time.monotonic(), llm.stats()
            runs, hf, lora_runs = [], [], []
            for _ in range(num_iters):  # taking turns with transformers, as bench throughput
                runs.append(_timed_batch(llm, prompts, output_len))
                if loras:
                    lora_runs.append(_timed_batch(llm, prompts, output_len,
                                                  spread(loras, batch_size)))
                if hf_run is not None:
                    hf.append(on_passing_thread(hf_run))
            breakdown = step_breakdown(llm, since) if profile else None
            stats, config = llm.stats(), llm.config
        finally:
            llm.shutdown()
    ttft = statistics.median(r[0] for r in runs)
    e2e = statistics.median(r[1] for r in runs)
    tpot = statistics.median((r[1] - r[0]) / (output_len - 1) for r in runs)
    result = {
        "model": path.name, "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": config.kv_cache_dtype,
        "threads": torch.get_num_threads(), "batch_size": batch_size, "input_len": input_len,
        "output_len": output_len, "num_iters": num_iters, "workload": workload,
        "ttft_ms": round(1e3 * ttft, 2), "tpot_ms": round(1e3 * tpot, 2),
        "decode_tokens_per_s": round(batch_size / tpot, 2), "e2e_s": round(e2e, 3),
    }
    if breakdown is not None:
        result["profile"] = breakdown
    drafts, draft_tokens, accepted = (stats[key] - before[key] for key in (
        "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens"))
    if drafts:  # speculative decoding: tokens per verification, over the timed runs
        result["spec_acceptance_length"] = round(1 + accepted / drafts, 3)
        result["spec_draft_acceptance_rate"] = round(accepted / draft_tokens, 3)
    if loras:
        decode_ratios = [(r[1] - r[0]) / (lr[1] - lr[0]) for r, lr in zip(runs, lora_runs)]
        lora_tpot = statistics.median((r[1] - r[0]) / (output_len - 1) for r in lora_runs)
        result.update({
            **lora_fields(loras, config),
            "lora_ttft_ms": round(1e3 * statistics.median(r[0] for r in lora_runs), 2),
            "lora_tpot_ms": round(1e3 * lora_tpot, 2),
            "lora_decode_tokens_per_s": round(batch_size / lora_tpot, 2),
            # each run with adapters against the run without right before it
            "decode_ratio_lora_vs_base": round(statistics.median(decode_ratios), 3),
            "decode_ratios_lora_vs_base": [round(ratio, 3) for ratio in decode_ratios],
        })
    if compare_hf:
        hf_ttft = statistics.median(r[0] for r in hf)
        hf_tpot = statistics.median((r[1] - r[0]) / (output_len - 1) for r in hf)
        # each engine run against the transformers run right after it
        decode_ratios = [(h[1] - h[0]) / (r[1] - r[0]) for r, h in zip(runs, hf)]
        result.update({
            "hf_ttft_ms": round(1e3 * hf_ttft, 2), "hf_tpot_ms": round(1e3 * hf_tpot, 2),
            "hf_decode_tokens_per_s": round(batch_size / hf_tpot, 2),
            "hf_e2e_s": round(statistics.median(r[1] for r in hf), 3),
            "decode_ratio_vs_hf": round(statistics.median(decode_ratios), 3),
            "decode_ratios_vs_hf": [round(ratio, 3) for ratio in decode_ratios],
            "ttft_ratio_vs_hf": round(statistics.median(
                r[0] / h[0] for r, h in zip(runs, hf)), 3),
        })
    return result


def _timed_batch(llm, prompts: list[list[int]], output_len: int,
                 loras: list[LoRARequest | None] | None = None) -> tuple[float, float]:
    """(time to the last request's first token, time to the last token) of one batch, request
    i with adapter ``loras[i]`` (None: none)."""
    from actorlm.messages import SubmitRequest
    from actorlm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    sink: queue.Queue = queue.Queue()
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        llm.engine.frontend.ask(SubmitRequest(f"latency-{i}-{start}", ids, params, sink, True,
                                              None if loras is None else loras[i]))
    first: dict[str, float] = {}
    done = 0
    while done < len(prompts):
        output = sink.get()
        now = time.perf_counter()
        if output.outputs[0].token_ids:
            first.setdefault(output.request_id, now)
        done += output.finished
    return max(first.values()) - start, time.perf_counter() - start


def _hf_runner(path, dtype, prompts: list[list[int]], output_len: int):
    """transformers' model loaded and warmed up; the returned function times one run: (seconds
    for a one-token generate, seconds for an output_len-token generate)."""
    from actorlm.models.gguf_file import transformers_model

    model = transformers_model(path, dtype).eval()
    input_ids = torch.tensor(prompts)  # identical lengths: no padding
    pad = model.generation_config.pad_token_id
    kwargs = dict(do_sample=False, pad_token_id=pad if isinstance(pad, int) else 0)
    with torch.inference_mode():
        model.generate(input_ids=input_ids[:1], max_new_tokens=4, **kwargs)  # warm-up

    def timed_run() -> tuple[float, float]:
        with torch.inference_mode():
            start = time.perf_counter()
            model.generate(input_ids=input_ids, max_new_tokens=1, **kwargs)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(input_ids=input_ids, max_new_tokens=output_len,
                           min_new_tokens=output_len, **kwargs)
            return ttft, time.perf_counter() - start

    return timed_run
