"""The model runner: one device's persistent batch, input preparation, forward and sampling.

The worker keeps every request it has been sent (``_CachedState``) and receives only deltas for
them, so a decode step moves a handful of integers per request. Each step's scheduled tokens
are flattened into one unpadded batch; logits are computed only at the last token of the
requests that complete their context in this step (the others are mid-prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actorlm.kernels import KernelBackend
from actorlm.messages import NewRequestData, ScheduleStep, StepResult
from actorlm.models.metadata import AttentionMetadata

_GREEDY_EPS = 1e-5


@dataclass
class _CachedState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int

    @classmethod
    def from_new(cls, data: NewRequestData) -> _CachedState:
        return cls(list(data.token_ids), data.num_prompt_tokens, list(data.block_ids),
                   data.num_computed_tokens, data.temperature, data.top_p, data.top_k,
                   data.min_p, data.seed)


class ModelRunner:
    def __init__(self, model, backend: KernelBackend, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.model, self.backend = model, backend
        self.block_size, self.device = block_size, device
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        # one (k, v) pair per layer: [num_blocks, block_size, Hkv, D]
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(model.num_layers)]
        self.requests: dict[str, _CachedState] = {}

    def execute(self, step: ScheduleStep) -> StepResult:
        """Run one step. On a fault, the step's requests are forgotten and reported failed."""
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
        for data in step.new_requests:
            self.requests[data.request_id] = _CachedState.from_new(data)
        for delta in step.cached_requests:
            state = self.requests[delta.request_id]
            state.block_ids.extend(delta.new_block_ids)
            state.num_computed_tokens = delta.num_computed_tokens
        request_ids = [d.request_id for d in step.new_requests] + \
                      [d.request_id for d in step.cached_requests]
        try:
            sampled_ids, tokens = self._run(request_ids, step.num_scheduled_tokens)
        except Exception as exc:  # noqa: BLE001 — a fault fails this step's requests only
            for request_id in request_ids:
                self.requests.pop(request_id, None)
            return StepResult(step.step_id, [], [], f"{type(exc).__name__}: {exc}", request_ids)
        return StepResult(step.step_id, sampled_ids, tokens)

    @torch.inference_mode()
    def _run(self, request_ids: list[str], num_scheduled: list[int]) -> tuple[list[str], list[int]]:
        states = [self.requests[rid] for rid in request_ids]
        input_ids, positions, slots, seq_lens, logits_rows, query_start = [], [], [], [], [], [0]
        bs = self.block_size
        for state, n in zip(states, num_scheduled):
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            input_ids += state.token_ids[start:end]
            positions += range(start, end)
            slots += [state.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            seq_lens.append(end)
            query_start.append(query_start[-1] + n)
            if end == len(state.token_ids):  # context complete: this step samples a token
                logits_rows.append(query_start[-1] - 1)
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in states]

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(block_table, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=max(num_scheduled), max_seq_len=max(seq_lens))
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev),
                            self.kv_caches, meta)  # [T, hidden]
        sampling = [(rid, s) for rid, s, n in zip(request_ids, states, num_scheduled)
                    if s.num_computed_tokens + n == len(s.token_ids)]
        if not sampling:
            return [], []
        logits = self.model.compute_logits(hidden[logits_rows])  # [N, V] fp32
        tokens = self._sample(logits, [s for _, s in sampling]).tolist()
        for (_, state), token in zip(sampling, tokens):
            state.token_ids.append(token)
        return [rid for rid, _ in sampling], tokens

    def _sample(self, logits: torch.Tensor, states: list[_CachedState]) -> torch.Tensor:
        if all(s.temperature < _GREEDY_EPS for s in states):
            return logits.argmax(dim=-1)  # skips building per-row parameter tensors
        dev = logits.device

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=dev)

        return self.backend.sample(
            logits,
            column([s.temperature for s in states], torch.float32),
            column([s.top_k for s in states], torch.int32),
            column([s.top_p for s in states], torch.float32),
            column([s.min_p for s in states], torch.float32),
            column([s.seed for s in states], torch.int64),
            column([len(s.token_ids) - s.num_prompt_tokens for s in states], torch.int64))
