"""The model runner: one device's cached request state, input preparation, forward and sampling.

The worker keeps every request it has been sent (``_CachedState``) and receives only deltas for
them, so a decode step moves a handful of integers per request. Each step's scheduled tokens
are flattened into one unpadded batch; logits are computed only at the last token of the
requests that complete their context in this step (the others are mid-prefill), plus the prompt
positions of requests that asked for prompt logprobs.

KV-cache groups (``actorlm.kv_groups``): the cache is ``group_size`` (k, v) tensor pairs, and
layer ``i`` stores into pair ``slot_of[i]`` whichever group it is in, so a block id is the same
page in every group. Each request has a block table per group (a sliding-window group's
entries below its window may hold any id: no query reads them), and each step one attention
metadata per group, which the layers of that group read.

Tensor-parallel, every rank runs this same step over its shard of the model, logits included
(they are gathered onto rank 0 by a collective, so every rank computes the same rows in the
same order). Only rank 0 samples and answers; the others return an empty ``StepResult`` and
learn the sampled tokens from the next step's ``ScheduleStep.last_token_ids``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from actorlm.kernels import KernelBackend
from actorlm.kv_groups import KVCacheGroup, layer_slots
from actorlm.lora_request import LoRARequest
from actorlm.messages import (GrammarBitmask, NewRequestData, PromptLogprobs, ScheduleStep,
                              StepResult)
from actorlm.models.parallel import TensorParallel
from actorlm.models.pooler import PooledState, Pooler
from actorlm.models.sampler import sample, token_logprobs, verify
from actorlm.pooling import PoolerConfig, PoolingParams
from actorlm.sampling_params import SamplingParams


@dataclass
class _CachedState:
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    block_tables: list[list[int]]  # one per KV-cache group
    num_computed_tokens: int
    sampling_params: SamplingParams
    seed: int
    bad_words_token_ids: list[list[int]]
    spec_token_ids: list[int] = field(default_factory=list)  # this step's drafts
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None  # an embedding's: pooled, never sampled
    pooled: PooledState | None = None  # (with pooling_params) what its chunks left

    @classmethod
    def from_new(cls, data: NewRequestData, num_groups: int) -> _CachedState:
        return cls(list(data.token_ids), data.num_prompt_tokens,
                   _block_tables(data, num_groups), data.num_computed_tokens,
                   data.sampling_params, data.seed, data.bad_words_token_ids,
                   lora_request=data.lora_request, pooling_params=data.pooling_params,
                   pooled=None if data.pooling_params is None else PooledState())


def _attention_rows(states: list[_CachedState], num_scheduled: list[int], seq_lens: list[int]
                    ) -> tuple[list[int], list[int], list[int]]:
    """The step's attention as (q_lens, seq_lens, owner request index) per query group: each
    request's chunk is one group, except that a request verifying drafts attends as one decode
    row per token, row j seeing its context up to its own position. That is causal attention
    all the same (every row's K/V is written before any row attends), and it makes a verify
    step a decode step to the backend: the one-call C++ decode step then takes it whole,
    where a short "prefill" of k + 1 tokens would send every layer through Python."""
    q_lens, context_lens, owners = [], [], []
    for i, (state, n, end) in enumerate(zip(states, num_scheduled, seq_lens)):
        if n > 1 and state.spec_token_ids and end > len(state.token_ids):
            q_lens += [1] * n
            context_lens += range(end - n + 1, end + 1)
            owners += [i] * n
        else:
            q_lens.append(n)
            context_lens.append(end)
            owners.append(i)
    return q_lens, context_lens, owners


def _block_tables(data: NewRequestData, num_groups: int) -> list[list[int]]:
    """A new request's table per group."""
    tables = data.block_ids
    if not tables:
        return [[] for _ in range(num_groups)]
    if len(tables) != num_groups or isinstance(tables[0], int):
        raise ValueError(f"{data.request_id}: block tables for {len(tables)} KV-cache groups "
                         f"where the model has {num_groups}: the block pool and the model "
                         f"disagree on the model's groups")
    return [list(table) for table in tables]


@dataclass
class _Sampling:
    """A step between its forward and its sampling: ``rows[j]`` (an index into
    ``request_ids``) owns row ``j`` of ``logits``."""

    step_id: int
    request_ids: list[str]
    states: list[_CachedState]
    rows: list[int]
    logits: torch.Tensor | None  # a row per sampled request, or per verified draft and its bonus
    prompt_logprobs: list[PromptLogprobs]
    timings: list[float]  # input preparation, forward
    logits_s: float  # logits and prompt logprobs so far
    moe_seconds: tuple[float, float] | None  # the forward's (router, experts); None: untimed
    pooled: dict[str, bytes]  # embeddings of the pooling requests whose prompt is complete


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: bytes) -> None:
    """Disallow (-inf) every token whose bit is clear in its row's words (``GrammarBitmask``),
    with xgrammar's kernel for the device (a C++ loop on a CPU, Triton or CUDA on a GPU)."""
    import xgrammar

    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).view(len(rows), -1)
    constrained = logits[rows]
    xgrammar.apply_token_bitmask_inplace(constrained, words.to(logits.device),
                                         vocab_size=logits.shape[-1])
    logits[rows] = constrained


class ModelRunner:
    """The KV-cache groups are the model's (``model.kv_cache_groups``, whose layers read their
    group's metadata); a model without them has one full-attention group of every layer.
    ``pooler``: a pooling model's (``actorlm.pooling``), whose requests end with their prompt
    pooled (``models/pooler.py``) where a generating model's sample."""

    def __init__(self, model, backend: KernelBackend, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device,
                 eos_token_ids: frozenset[int] = frozenset(),
                 tp: TensorParallel = TensorParallel(), proposer=None, lora_slots=None,
                 pooler: PoolerConfig | None = None, logprobs_mode: str = "raw_logprobs",
                 kv_cache_dtype: torch.dtype | None = None):
        self.model, self.backend, self.tp = model, backend, tp
        self.pooler = None if pooler is None else \
            Pooler(pooler, getattr(model, "score", None), dtype)
        self.lora_slots = lora_slots  # the model's LoRA adapters (``LoRASlots``); None: off
        self.proposer = proposer  # speculative decoding's (``speculative.Proposer``); None: off
        self._moe_timer = getattr(model, "moe_timer", None)  # None: no MoE layers, or a GPU
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.kv_cache_dtype = kv_cache_dtype or dtype  # what the KV pool stores
        self.eos_token_ids = eos_token_ids
        self.logprobs_mode = logprobs_mode  # (``models/sampler.py``)
        groups = getattr(model, "kv_cache_groups", None) or \
            [KVCacheGroup(None, tuple(range(model.num_layers)))]
        if sorted(layer for g in groups for layer in g.layers) != list(range(model.num_layers)):
            raise ValueError(f"the KV-cache groups {groups} do not cover the model's "
                             f"{model.num_layers} layers once each")
        self.kv_cache_groups = list(groups)
        self.num_kv_groups = len(groups)
        self._slot_of = layer_slots(groups)[1]
        self.allocate_kv_cache(num_blocks)
        self.requests: dict[str, _CachedState] = {}

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """A zeroed pool of ``num_blocks`` blocks in place of the current one, which is freed
        first (so the two never coexist on the device)."""
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        shape = (num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        # one (k, v) pair per layer of a group: [num_blocks, block_size, Hkv, D]
        self.kv_pairs = [(torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                          torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))
                         for _ in range(max(len(g.layers) for g in self.kv_cache_groups))]
        # per layer, as the model takes them: layer i stores into pair slot_of[i]
        self.kv_caches = [self.kv_pairs[slot] for slot in self._slot_of]
        if self.proposer is not None:  # a draft model's own pool has as many blocks
            self.proposer.allocate_kv_cache(num_blocks)

    def execute(self, step: ScheduleStep) -> StepResult | None:
        """Run one step. A fault raises: the worker is then replaced and the step recomputed
        (``actors/executor.py``). None: constrained requests sample once the step's
        ``GrammarBitmask`` reaches ``sample_tokens`` (on rank 0 only: the other tensor-parallel
        ranks do not sample and answer at once)."""
        t_start = time.perf_counter()
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
            if self.proposer is not None:
                self.proposer.forget(request_id)
        for data in step.new_requests:
            self.requests[data.request_id] = _CachedState.from_new(data, self.num_kv_groups)
        for delta in step.cached_requests:
            state = self.requests[delta.request_id]
            if delta.new_block_ids:  # (empty: no group got a block)
                for table, new_ids in zip(state.block_tables, delta.new_block_ids, strict=True):
                    table.extend(new_ids)
            state.num_computed_tokens = delta.num_computed_tokens
        if not self.tp.is_driver:
            self._learn_sampled_tokens(step)
        for delta, drafts in zip(step.cached_requests,
                                 step.spec_token_ids or [[]] * len(step.cached_requests)):
            self.requests[delta.request_id].spec_token_ids = drafts
        self._sampling = self._forward(step, t_start)
        if step.structured_request_ids and self.tp.is_driver:
            return None
        return self.sample_tokens()

    @torch.inference_mode()
    def sample_tokens(self, bitmask: GrammarBitmask | None = None) -> StepResult:
        """Sample the step whose forward ran last, constrained by ``bitmask`` if given."""
        s, self._sampling = self._sampling, None
        if s is None or (bitmask is not None and bitmask.step_id != s.step_id):
            raise RuntimeError("a grammar bitmask for a step this runner is not sampling")
        t_sample = time.perf_counter()
        router_s, experts_s = s.moe_seconds or (None, None)
        if not self.tp.is_driver:  # rank 0 samples and answers for the step
            return StepResult(s.step_id, [], [], timings=[*s.timings, s.logits_s],
                              router_s=router_s, experts_s=experts_s)
        sampled_ids = [s.request_ids[i] for i in s.rows]
        states = [s.states[i] for i in s.rows]
        drafts = [state.spec_token_ids for state in states]
        outputs, logprobs = [], []  # per sampled request: its new tokens, their logprobs
        if s.rows:
            if bitmask is not None:  # (a request's first row: after its drafts' rows)
                firsts = itertools.accumulate([len(d) + 1 for d in drafts], initial=0)
                row_of = dict(zip(sampled_ids, firsts))
                apply_token_bitmask(s.logits, [row_of[rid] for rid in bitmask.request_ids],
                                    bitmask.bitmask)
            if any(drafts):
                outputs, logprobs = verify(s.logits, states, drafts, self.backend,
                                           self.eos_token_ids, self.logprobs_mode)
            else:
                tokens, found = sample(s.logits, states, self.backend, self.eos_token_ids,
                                       self.logprobs_mode)
                outputs, logprobs = [[t] for t in tokens], [[lp] for lp in found]
            for state, new_tokens in zip(states, outputs):
                state.token_ids += new_tokens
        spec = {}
        if self.proposer is not None and s.rows:  # the next step's drafts, from what is known now
            spec["spec_token_ids"] = self.proposer.propose_all(sampled_ids,
                                                               [st.token_ids for st in states])
            if any(drafts):
                spec["accepted_token_ids"] = [out[:-1] for out in outputs]
                spec["accepted_logprobs"] = [lp[:-1] if lp else [] for lp in logprobs]
        timings = [*s.timings, s.logits_s + time.perf_counter() - t_sample]
        return StepResult(s.step_id, sampled_ids, [out[-1] for out in outputs],
                          logprobs=[lp[-1] if lp else None for lp in logprobs],
                          prompt_logprobs=s.prompt_logprobs, timings=timings,
                          router_s=router_s, experts_s=experts_s,
                          pooled_request_ids=list(s.pooled), pooled=list(s.pooled.values()),
                          **spec)

    @torch.inference_mode()
    def _forward(self, step: ScheduleStep, t_start: float) -> _Sampling:
        request_ids, num_scheduled = step.request_ids, step.num_scheduled_tokens
        states = [self.requests[rid] for rid in request_ids]
        input_ids, positions, seq_lens, query_start = [], [], [], [0]
        for state, n in zip(states, num_scheduled):
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            input_ids += state.token_ids[start:end]
            if state.spec_token_ids:  # (the step verifies them: they follow its last token)
                input_ids += state.spec_token_ids[:end - len(state.token_ids)]
            positions += self.model.rope_rows(start, end, state.num_prompt_tokens)
            seq_lens.append(end)
            query_start.append(query_start[-1] + n)
        dev = self.device
        q_lens, context_lens, owners = _attention_rows(states, num_scheduled, seq_lens)
        metas = [self.backend.attention_metadata(q_lens, context_lens,
                                                 [states[i].block_tables[g] for i in owners],
                                                 self.block_size)
                 for g in range(self.num_kv_groups)]  # one per KV-cache group
        input_ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(positions, dtype=torch.int64, device=dev)
        if self.lora_slots is not None:
            self.lora_slots.set_mapping([s.lora_request for s in states], num_scheduled)
        t_prepared = time.perf_counter()
        hidden = self.model(input_ids, positions, self.kv_caches, metas)  # [T, hidden]
        t_forward = time.perf_counter()
        timer = self._moe_timer
        moe_seconds = None if timer is None else (timer.router_s, timer.experts_s)
        prompt_logprobs = self._prompt_logprobs(hidden, request_ids, states, num_scheduled,
                                                query_start)
        pooled = self._pool(hidden, request_ids, states, num_scheduled, query_start)
        # a request whose context is complete after this step samples its next token (at
        # its last position, or at each of its drafts' and the one after them)
        rows = [i for i, (s, n) in enumerate(zip(states, num_scheduled))
                if s.num_computed_tokens + n == len(s.token_ids) + len(s.spec_token_ids)
                and s.pooling_params is None]
        last = [query_start[i + 1] - 1 - j for i in rows
                for j in range(len(states[i].spec_token_ids), -1, -1)]
        logits = self.model.compute_logits(hidden[last]) if rows else None  # [N, V] fp32
        return _Sampling(step.step_id, request_ids, states, rows, logits, prompt_logprobs,
                         [t_prepared - t_start, t_forward - t_prepared],
                         time.perf_counter() - t_forward, moe_seconds, pooled)

    def _pool(self, hidden, request_ids, states, num_scheduled, query_start) -> dict[str, bytes]:
        """Each pooling request's chunk added to its pooling; the embeddings of those whose
        prompt this step completes (rank 0's: the others' would be the same)."""
        if self.pooler is None:  # a generating model's step: nothing to look at
            return {}
        pooled = {}
        for i, (state, n) in enumerate(zip(states, num_scheduled)):
            if state.pooling_params is None:
                continue
            rows = hidden[query_start[i]:query_start[i] + n]
            self.pooler.add_chunk(state.pooled, rows, state.num_computed_tokens == 0)
            if state.num_computed_tokens + n == len(state.token_ids) and self.tp.is_driver:
                pooled[request_ids[i]] = self.pooler.finish(state.pooled, rows[-1],
                                                            len(state.token_ids),
                                                            state.pooling_params)
        return pooled

    def _learn_sampled_tokens(self, step: ScheduleStep) -> None:
        """Not rank 0: append the tokens rank 0 sampled for the step's cached requests. A
        request lacks them exactly when the step computes past the tokens this rank holds."""
        if len(step.last_token_ids) != len(step.cached_requests):
            raise RuntimeError("a tensor-parallel rank needs ScheduleStep.last_token_ids: one "
                               "per cached request")
        num_new = len(step.new_requests)
        drafts = step.spec_token_ids or [[]] * len(step.cached_requests)
        for i, (delta, token) in enumerate(zip(step.cached_requests, step.last_token_ids)):
            state = self.requests[delta.request_id]
            missing = delta.num_computed_tokens + step.num_scheduled_tokens[num_new + i] - \
                len(drafts[i]) - len(state.token_ids)
            if missing > 0:  # its last step's output: the drafts it accepted, then ``token``
                state.token_ids += state.spec_token_ids[:missing - 1] + [token]

    def _prompt_logprobs(self, hidden, request_ids, states, num_scheduled,
                         query_start) -> list[PromptLogprobs]:
        """Logprobs of the prompt tokens that this step's positions predict, where asked."""
        out = []
        for i, (state, n) in enumerate(zip(states, num_scheduled)):
            k = state.sampling_params.prompt_logprobs
            start = state.num_computed_tokens
            # position p predicts prompt token p + 1, which exists while p + 1 < num_prompt_tokens
            end = min(start + n, state.num_prompt_tokens - 1)
            if k is None or end <= start:
                continue
            rows = hidden[query_start[i]:query_start[i] + end - start]
            logits = self.model.compute_logits(rows)  # [end - start, V]; None off rank 0
            if logits is None:
                continue
            targets = state.token_ids[start + 1:end + 1]
            out.append(PromptLogprobs(request_ids[i], start + 1,
                                      token_logprobs(logits, targets, [k] * len(targets),
                                                     # (a prompt's: its raw logits, no
                                                     # request's processing)
                                                     self.logprobs_mode.endswith("_logits"))))
        return out
