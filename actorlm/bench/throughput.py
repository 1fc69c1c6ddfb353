"""``actorlm bench throughput``: offline throughput of the engine, optionally against transformers.

Every request decodes exactly ``output_len`` tokens (EOS ignored, greedy) from a fixed set of
distinct chat prompts, so runs are comparable across machines and commits. ``--compare hf``
runs transformers' batched ``generate`` (left-padded, same dtype, same threads) on the same
prompt ids in the same process, taking turns with the engine run by run (the engine idle
meanwhile): on a shared machine whose speed drifts from minute to minute, each ratio compares
two runs a few seconds apart, and ``ratio_vs_hf`` is the median of those ratios. With
``--lora-path`` (``bench.lora``) each run is followed by the same prompts spread over LoRA
adapters, and ``ratio_lora_vs_base`` is the median of those pairs' ratios.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time

import torch

from actorlm.bench.lora import lora_fields, spread
from actorlm.lora_request import LoRARequest
from actorlm.openmp import on_passing_thread

_TOPICS = ["a lighthouse", "the ocean", "a mountain village", "a robot", "an old library",
           "a desert caravan", "a winter forest", "a space station", "a jazz club", "a garden",
           "a river delta", "a night train", "a bakery", "a chess match", "a volcano", "a comet"]
_TASKS = ["Write a short story about {}.", "Describe {} in vivid detail.",
          "Explain how {} might change over a century.", "Write a poem about {}."]


def bench_prompts(num_prompts: int) -> list[list[dict]]:
    """Deterministic, distinct chat conversations."""
    convs = []
    for i in range(num_prompts):
        topic, task = _TOPICS[i % len(_TOPICS)], _TASKS[(i // len(_TOPICS)) % len(_TASKS)]
        text = task.format(topic) + (f" Variation {i // 64}." if i >= 64 else "")
        convs.append([{"role": "user", "content": text}])
    return convs


def conversation_ids(llm, conversation: list[dict]) -> list[int]:
    """A conversation's prompt through the model's chat template; a base model without one
    (Gemma 3 270M's file) gets the messages' text as a plain prompt."""
    if llm.tokenizer.chat_template is not None:
        return llm.apply_chat_template(conversation)
    return llm.tokenizer("\n".join(m["content"] for m in conversation)).input_ids


@contextlib.contextmanager
def profiled(enabled: bool):
    """A temporary trace file to record into (None when ``enabled`` is false)."""
    if not enabled:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="actorlm-trace-") as trace_dir:
        yield os.path.join(trace_dir, "bench.jsonl")


def step_breakdown(llm, since: float) -> dict:
    """Where the engine's steps since ``since`` (monotonic) went (see ``trace.profile``)."""
    from actorlm.trace.step_breakdown import breakdown

    llm.flush_trace()
    return breakdown(llm.trace.records(), since)


def run_throughput(model: str | None, flags: dict, num_prompts: int, output_len: int,
                   compare_hf: bool = False, num_iters: int = 1, trace: bool = False,
                   profile: bool = False, loras: list[LoRARequest] | None = None) -> dict:
    """``trace``: record the run into a temporary trace file (to measure tracing's cost);
    ``profile``: record it and report the per-step breakdown; ``loras``: each run without
    adapters is followed by one of the same prompts spread over these (``bench.lora``)."""
    from actorlm.llm import LLM
    from actorlm.sampling_params import SamplingParams

    if min(num_prompts, output_len, num_iters) < 1:
        raise ValueError("--num-prompts, --output-len and --num-iters must be at least 1")
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    with profiled(trace or profile) as trace_file:
        llm = LLM(model, trace_file=trace_file, **flags)
        try:
            prompt_ids = [conversation_ids(llm, c) for c in bench_prompts(num_prompts)]
            num_prompt_tokens = sum(map(len, prompt_ids))
            # warm-up: first-call allocations and thread start-up (each adapter read into its
            # slot, as a serving engine has them)
            for lora in [None, *(loras or ())]:
                llm.generate([{"prompt_token_ids": prompt_ids[0]}], SamplingParams(max_tokens=4),
                             use_tqdm=False, lora_request=lora)
            path, dtype = llm.engine.model_path, llm.engine.dtype
            hf_run = on_passing_thread(_hf_runner, path, dtype, prompt_ids, output_len) \
                if compare_hf else None
            since = time.monotonic()
            runs, hf_runs, lora_runs = [], [], []
            prompts = [{"prompt_token_ids": p} for p in prompt_ids]
            for _ in range(num_iters):
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                runs.append(time.perf_counter() - start)
                if loras:
                    start = time.perf_counter()
                    lora_outputs = llm.generate(prompts, params, use_tqdm=False,
                                                lora_request=spread(loras, num_prompts))
                    lora_runs.append(time.perf_counter() - start)
                if hf_run is not None:
                    hf_runs.append(on_passing_thread(hf_run))
            num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
            stats, config = llm.stats(), llm.config
            breakdown = step_breakdown(llm, since) if profile else None
        finally:
            llm.shutdown()
        trace_bytes = os.path.getsize(trace_file) if trace_file else None
    elapsed = statistics.median(runs)
    result = {
        "model": path.name, "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": config.kv_cache_dtype,
        "num_prompts": num_prompts, "output_len": output_len, "num_iters": num_iters,
        "threads": torch.get_num_threads(), "prompt_tokens": num_prompt_tokens,
        "output_tokens": num_output, "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(num_prompts / elapsed, 3),
        "output_tokens_per_s": round(num_output / elapsed, 2),
        "total_tokens_per_s": round((num_output + num_prompt_tokens) / elapsed, 2),
        "num_preemptions": stats["num_preemptions"],
    }
    if trace:
        result["trace_file_bytes"] = trace_bytes
    if breakdown is not None:
        result["profile"] = breakdown
    if loras:
        num_lora_output = sum(len(o.outputs[0].token_ids) for o in lora_outputs)
        lora_elapsed = statistics.median(lora_runs)
        result.update({
            **lora_fields(loras, config), "lora_elapsed_s": round(lora_elapsed, 3),
            "lora_output_tokens_per_s": round(num_lora_output / lora_elapsed, 2),
            # each run with adapters against the run without right before it
            "ratio_lora_vs_base": round(statistics.median(
                base / lora for base, lora in zip(runs, lora_runs)), 3),
            "ratios_lora_vs_base": [round(base / lora, 3) for base, lora in zip(runs, lora_runs)],
        })
    if compare_hf:
        hf_elapsed = statistics.median(hf_runs)
        hf_tps = num_prompts * output_len / hf_elapsed
        # each run's ratio against the transformers run right after it (same token counts)
        ratio = statistics.median(hf / ours for ours, hf in zip(runs, hf_runs))
        result.update({"hf_elapsed_s": round(hf_elapsed, 3),
                       "hf_output_tokens_per_s": round(hf_tps, 2),
                       "ratio_vs_hf": round(ratio, 3)})
    return result


def _hf_runner(path, dtype, prompt_ids: list[list[int]], output_len: int):
    """transformers' model loaded and warmed up; the returned function times one batched run.
    Both run on a passing thread (``actorlm.openmp``): torch ops in this thread would give it
    an OpenMP pool of its own for good, and with more pool threads than cores the engine's
    worker stops spin-waiting between its ops (Gemma 3 270M decoded 2.4x slower)."""
    from actorlm.models.gguf_file import transformers_model

    model = transformers_model(path, dtype).eval()
    pad = model.generation_config.pad_token_id
    pad = pad if isinstance(pad, int) else 0
    width = max(map(len, prompt_ids))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  pad_token_id=pad)
    with torch.inference_mode():
        model.generate(input_ids=input_ids[:1], attention_mask=mask[:1], max_new_tokens=4,
                       do_sample=False, pad_token_id=pad)  # warm-up, as for the engine

    def timed_run() -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
            return time.perf_counter() - start

    return timed_run
