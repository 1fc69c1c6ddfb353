"""Sizing the KV pool on a GPU from a measured step, as vLLM does.

The engine may use ``--gpu-memory-utilization`` of the device's *total* memory. What the KV
pool gets is that share, less what is in use once the weights are loaded (weights, the CUDA
context, anyone else on the device), less the peak activation memory of the largest step the
scheduler can send. That step is run for real — through ``ModelRunner.execute``, on a KV cache
just big enough for it — because activation memory depends on the kernels, the sampler and the
allocator, which no formula tracks. The step itself is plain data and device-agnostic, so it
is tested on a CPU; only ``load_and_profile`` needs CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from actorlm.messages import NewRequestData, ScheduleStep, StepResult
from actorlm.models.runner import ModelRunner
from actorlm.sampling_params import MAX_LOGPROBS, SamplingParams

# Every sampler stage that allocates [N, V] tensors, so the profile covers the costliest step.
_COSTLIEST_SAMPLING = SamplingParams(
    temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
    frequency_penalty=0.5, presence_penalty=0.5, logprobs=MAX_LOGPROBS, max_tokens=1)


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int  # the device's memory
    used_bytes: int  # in use once the weights were loaded, by anyone
    peak_activation_bytes: int  # the largest step's peak beyond the weights and its KV cache


def kv_cache_budget(total_bytes: int, used_bytes: int, peak_activation_bytes: int,
                    utilization: float) -> int:
    """Bytes left for the KV pool: ``utilization * total - used - peak activations``."""
    budget = int(utilization * total_bytes) - used_bytes - peak_activation_bytes
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no GPU memory is left for the KV cache: --gpu-memory-utilization {utilization} "
            f"allows {utilization * total_bytes / gib:.2f} GiB of {total_bytes / gib:.2f} GiB, "
            f"but {used_bytes / gib:.2f} GiB is in use after loading the weights and the "
            f"largest step needs {peak_activation_bytes / gib:.2f} GiB of activations; raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens or --max-num-seqs, or "
            f"size the pool yourself with --num-kv-blocks")
    return budget


def largest_step(max_num_batched_tokens: int, max_num_seqs: int, block_size: int,
                 max_model_len: int | None = None, num_kv_groups: int = 1) -> ScheduleStep:
    """The biggest step the scheduler can send: ``max_num_batched_tokens`` tokens (fewer if
    ``max_model_len`` caps every sequence) of fresh prompts spread evenly over
    ``min(max_num_seqs, max_num_batched_tokens)`` sequences, each completing its prompt and so
    computing logits and sampling with every costly option on. Each sequence has a table of
    its own blocks in each of the ``num_kv_groups`` KV-cache groups; blocks are numbered
    from 0."""
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    num_tokens = max_num_batched_tokens
    if max_model_len is not None:
        num_tokens = min(num_tokens, num_seqs * max_model_len)
    base, extra = divmod(num_tokens, num_seqs)
    requests, num_scheduled, next_block = [], [], 0
    for i in range(num_seqs):
        n = base + (i < extra)
        num_blocks = -(-n // block_size)
        tables = []
        for _ in range(num_kv_groups):
            tables.append(list(range(next_block, next_block + num_blocks)))
            next_block += num_blocks
        requests.append(NewRequestData(f"profile-{i}", [0] * n, n, tables, 0,
                                       _COSTLIEST_SAMPLING, seed=i))
        num_scheduled.append(n)
    return ScheduleStep(0, requests, [], num_scheduled, [])


def num_blocks_needed(step: ScheduleStep) -> int:
    """The smallest KV pool that holds every block ``step`` uses."""
    return 1 + max(b for data in step.new_requests for table in data.block_ids for b in table)


def run_dummy_step(runner, step: ScheduleStep) -> StepResult:
    """Execute ``step`` on ``runner`` and forget its requests: the cached request state is left as
    it was (empty, for a fresh runner)."""
    try:
        return runner.execute(step)
    finally:
        for request_id in step.request_ids:
            runner.requests.pop(request_id, None)


def load_and_profile(load: Callable[[], Any], build_runner: Callable[[Any, int], ModelRunner],
                     step: ScheduleStep, device: torch.device) -> tuple[ModelRunner, MemoryProfile]:
    """CUDA only. ``load()`` the model, measure, ``build_runner(model, num_blocks)`` on a
    temporary KV cache for ``step``, run it and measure its peak; returns the runner (its KV
    cache freed: give it the real one with ``allocate_kv_cache``) and the figures."""
    model = load()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # loading's freed staging memory is no one's
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    runner = build_runner(model, num_blocks_needed(step))
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    reserved_before = torch.cuda.memory_reserved(device)
    allocated_before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_dummy_step(runner, step)
    torch.cuda.synchronize(device)
    torch_peak = torch.cuda.max_memory_allocated(device) - allocated_before
    # memory outside torch's allocator that the step took and kept (kernel modules, library
    # workspaces): the device's growth beyond what torch reserved
    device_growth = free_before - torch.cuda.mem_get_info(device)[0]
    non_torch = max(0, device_growth - (torch.cuda.memory_reserved(device) - reserved_before))
    runner.allocate_kv_cache(0)
    torch.cuda.empty_cache()
    return runner, MemoryProfile(total, used, torch_peak + non_torch)
