"""The scheduling policy: which requests compute how many tokens in the next step.

Design (vLLM V1's token-debt model). There is no prefill or decode phase: every request owes
``num_tokens - num_computed_tokens`` tokens, and each step pays down as much debt as the token
budget (``max_num_batched_tokens``), the sequence cap (``max_num_seqs``) and the free KV blocks
allow. Running requests are served first, in their order, so decodes are never starved by a
new prompt; a long prompt is split across steps (chunked prefill). When a running request needs
a block and none is free, the last running request is preempted: its blocks are released,
its computed tokens reset, and it returns to the waiting queue to be recomputed later — which
yields the same greedy tokens. No waiting request is admitted in a step that preempted, since
admitting one would only take blocks back from the victims. "Running first", "last" and where a
preempted request returns follow the scheduling policy (``core/waiting_queue.py``): arrival
order (fcfs: the newest is preempted and resumes first), or the requests' priorities.

A worker fault loses no request: the step did not happen and the workers forgot every request,
so every running request is preempted and recomputed. To tell a request that makes the worker
fault (a poison request) from the ones batched with it, a request in ``PROBATION_AFTER``
faulted steps is put on probation: it runs alone until one step of it succeeds. It fails when
it faults alone, or after ``MAX_FAULTS`` faulted steps in any company; no other request does.
A request resumed after engine-core deaths (``AddRequest.suspect``) goes on probation too; the
frontend, told which request a step runs alone (``EngineOutputs.on_trial``), blames it if the
core dies in that step.

Blocks are the allocator's alone (``core/block_pool.py``): the scheduler knows tokens, not
blocks. A plan is a proposal — every running request in priority order with the tokens it
would compute, and the waiting requests that fit the token budget and ``max_num_seqs`` — and
the allocator's grant decides it with the real counts: who is preempted when blocks run short
(the last first), which candidates are admitted, and where each admitted one starts (its
prefix-cache hit). So a step costs one round trip and the grant never fails. Each running
request's computed-token count goes with the proposal: from it the allocator knows which
blocks a sliding-window group no longer reads (``actorlm.kv_groups``).

The policy is pure and thread-free. Aborts are applied only between steps (``StepLoop`` defers
them while a step is in flight), so a step's requests never change under it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from actorlm.core.block_hash import extend_block_hashes
from actorlm.core.request import Request, RequestRefused
from actorlm.core.spec_decoding import SpecDecodingCounts
from actorlm.core.step_plan import StepPlan
from actorlm.core.structured_output import new_matcher
from actorlm.core.waiting_queue import WaitingQueue, start_running
from actorlm.fsm import FinishReason, RequestEvent, RequestState
from actorlm.fsm.machine import Listener
from actorlm.messages import (AddRequest, Admitted, CachedRequestData, ComputedBlocks,
                              EngineOutputs, NewRequestData, PromptLogprobs, RequestDelta,
                              ScheduleStep, SlotsGranted, StepResult, engine_request_ids)
from actorlm.sampling_params import SEED_RANGE


PROBATION_AFTER = 2  # faulted steps before a request runs alone
MAX_FAULTS = 4  # faulted steps before a request fails, even if it never faulted alone


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    enable_chunked_prefill: bool = True
    eos_token_ids: frozenset[int] = frozenset()
    enable_prefix_caching: bool = True
    speculative: bool = False  # the runner proposes drafts (``--speculative-config``)
    max_loras: int = 0  # distinct LoRA adapters in one step (``--max-loras``); 0: LoRA off
    scheduling_policy: str = "fcfs"  # or "priority" (``core/waiting_queue.py``)
    long_prefill_token_threshold: int = 0  # a request's tokens in one step at most; 0: no cap
    long_rope_from: int | None = None  # (``ModelParts``')


class Scheduler:
    def __init__(self, config: SchedulerConfig, listeners: Iterable[Listener] = ()):
        self.config = config
        self.listeners = list(listeners)
        self.requests: dict[str, Request] = {}  # every live (unfinished) request
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []  # in the policy's order: the last is preempted first
        self._to_free: list[str] = []  # released since the last AllocateSlots
        self._computed_blocks: list[ComputedBlocks] = []  # completed since the last one
        self._reset_prefix_cache = False
        # n > 1: children wait here until their leader (child 0) has prefilled the prompt,
        # then find it in the prefix cache
        self._pending_forks: dict[str, list[Request]] = {}
        self._dropped_by_workers: list[str] = []  # finished or preempted since the last step
        self._on_probation: set[str] = set()  # run alone until one step of theirs succeeds
        self._next_step_id = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_scheduled_tokens = 0
        self.num_prefill_tokens = 0  # computed at prompt (or recomputed) positions
        self.spec_decoding = SpecDecodingCounts()

    # --- intake -------------------------------------------------------------------------------

    def add_request(self, msg: AddRequest) -> None:
        """Queue a validated request. With ``n > 1`` and prefix caching, only its first child
        is queued: the others follow once it has prefilled the prompt they share."""
        ids = engine_request_ids(msg.request_id, msg.sampling_params.n)
        if taken := [rid for rid in ids if rid in self.requests]:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        if self.config.speculative and msg.sampling_params.structured_outputs is not None:
            raise RequestRefused(
                "structured_outputs", "a grammar cannot be combined with --speculative-config "
                "yet (drafts are not checked against it)")
        if msg.lora_request is not None and not self.config.max_loras:
            raise ValueError(f"LoRA adapter {msg.lora_request.lora_name!r}: LoRA is not "
                             f"enabled (--enable-lora)")
        children = [Request(rid, msg.prompt_token_ids, msg.sampling_params,
                            (msg.seed + i) % SEED_RANGE, msg.arrival_time, self.listeners,
                            msg.bad_words_token_ids, msg.lora_request, msg.cache_salt,
                            msg.priority, msg.pooling_params, self.config.long_rope_from)
                    for i, rid in enumerate(ids)]
        if msg.output_token_ids:  # resumed: its prompt's logprobs went out before its tokens
            if len(children) > 1 or msg.sampling_params.structured_outputs is not None:
                raise ValueError("the engine core restarted, and a request under a grammar "
                                 "cannot resume once it has tokens (nor one of n children)")
            children[0].output_token_ids = list(msg.output_token_ids)
            children[0].num_prompt_logprobs_sent = len(msg.prompt_token_ids)
        for request in children:
            self.requests[request.request_id] = request
        if msg.suspect:  # an engine core died with it more than once: it runs alone first
            self._on_probation.update(ids)
        if len(children) > 1 and self.config.enable_prefix_caching:
            self.waiting.add(children[0])
            self._pending_forks[children[0].request_id] = children[1:]
        else:
            for child in children:
                self.waiting.add(child)

    def abort(self, request_ids: Iterable[str], event=RequestEvent.ABORT,
              error: str | None = None, stop_reasons: Iterable[str] | None = None,
              error_field: str | None = None) -> list[RequestDelta]:
        """Finish the given live requests (unknown or finished ids are ignored). Between steps
        only. ``event`` FINISH with ``stop_reasons`` finishes them as stopped (stop strings);
        FAIL with ``error`` (and ``error_field``, where a request field is at fault)."""
        reason = {RequestEvent.ABORT: FinishReason.ABORT, RequestEvent.FAIL: FinishReason.ERROR,
                  RequestEvent.FINISH: FinishReason.STOP}[event]
        stop_reasons = list(stop_reasons) if stop_reasons is not None else [None] * len(request_ids)
        deltas = []
        for request_id, stop_reason in zip(request_ids, stop_reasons):
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.state is RequestState.RUNNING:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            else:  # a child still waiting for its fork
                for siblings in self._pending_forks.values():
                    if request in siblings:
                        siblings.remove(request)
            request.error, request.error_field = error, error_field
            request.stop_reason = stop_reason
            self._release_pending_forks(request)
            deltas.append(self._finish(request, event, reason))
        return deltas

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """The adapters of the running and of the waiting requests, by name, sorted: vLLM's
        ``running_lora_adapters`` and ``waiting_lora_adapters``."""
        return _lora_names(self.running), _lora_names(self.waiting)

    # --- one step -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Propose the next step; None when there is nothing to compute and nothing to tell
        the allocator."""
        cfg = self.config
        plan = StepPlan(self._next_step_id)
        budget = cfg.max_num_batched_tokens
        suspect = next((r for r in self.waiting if r.request_id in self._on_probation), None) \
            if self._on_probation else None  # (empty unless a worker has faulted)
        if suspect is not None:  # it runs alone: the others make room
            for request in reversed(list(self.running)):
                self._preempt(request, plan)
            self._propose(plan, suspect, budget)
            plan.on_trial = suspect.request_id
        else:
            for request in self.running:  # (drafts count against the budget: they compute)
                num_tokens = min(self._capped(request.num_tokens_with_spec -
                                              request.num_computed_tokens), budget)
                plan.running.append(request)
                plan.running_tokens.append(num_tokens)
                budget -= num_tokens
            num_seqs = len(self.running)
            adapters = {r.lora_id for r in self.running} - {None}
            lora_blocked = False  # a request waits for an adapter slot
            for request in self.waiting:
                if request.awaiting_grammar:
                    continue  # still compiling: the ones behind it need not wait
                if request.lora_id is not None and (
                        lora_blocked or request.lora_id not in adapters):
                    # a step holds max_loras adapters: this one waits for a slot, and no
                    # adapter's request overtakes it (the running ones drain, it gets in)
                    if lora_blocked or len(adapters) >= cfg.max_loras:
                        lora_blocked = True
                        continue
                    adapters.add(request.lora_id)
                num_tokens = request.num_tokens - request.num_computed_tokens
                if budget <= 0 or num_seqs >= cfg.max_num_seqs or (
                        num_tokens > budget and not cfg.enable_chunked_prefill):
                    break
                budget -= self._propose(plan, request, budget)
                num_seqs += 1
        plan.free_request_ids, self._to_free = self._to_free, []
        plan.computed_blocks, self._computed_blocks = self._computed_blocks, []
        plan.reset_prefix_cache, self._reset_prefix_cache = self._reset_prefix_cache, False
        if plan.is_empty:
            return None
        self._next_step_id += 1
        return plan

    def on_slots_granted(self, plan: StepPlan, granted: SlotsGranted) -> ScheduleStep | None:
        """Apply the allocator's decision; the step message (None when nothing runs)."""
        for request_id in granted.preempted_ids:  # their blocks are already released
            self._preempt(self.requests[request_id], plan, release=False)
        new, cached, last_token_ids, drafts = [], [], [], []
        for request, num_tokens, block_ids in zip(plan.running, plan.running_tokens,
                                                  granted.new_block_ids):
            for group_ids in block_ids:  # (empty: no group got a block)
                request.num_blocks += len(group_ids)
            if num_tokens:
                cached.append(CachedRequestData(request.request_id, block_ids,
                                                request.num_computed_tokens))
                last_token_ids.append(request.output_token_ids[-1] if request.output_token_ids
                                      else request.prompt_token_ids[-1])
                # the drafts within the budget are the ones the step verifies
                owed = request.num_tokens - request.num_computed_tokens
                request.spec_token_ids = request.spec_token_ids[:max(0, num_tokens - owed)]
                drafts.append(request.spec_token_ids)
                self._add_to_step(plan, request, num_tokens)
        for admitted in granted.admitted:
            request = self.requests[admitted.request_id]
            self._admit(request, admitted)
            new.append(self._new_request_data(request, admitted.block_ids))
            request.is_known_to_workers = True
            self._add_to_step(plan, request, admitted.num_new_tokens)
            plan.num_cached_tokens += admitted.num_cached_tokens
        dropped, self._dropped_by_workers = self._dropped_by_workers, []
        if not plan.requests:
            self._dropped_by_workers = dropped  # nothing runs: tell the workers next time
            return None
        # cached requests were added first, new ones after: the step lists new ones first
        counts = plan.num_scheduled_tokens[len(cached):] + plan.num_scheduled_tokens[:len(cached)]
        constrained = [r.request_id for r in plan.requests
                       if r.grammar is not None and r.num_computed_tokens == r.num_tokens]
        return ScheduleStep(plan.step_id, new, cached, counts, dropped, constrained,
                            last_token_ids, drafts if any(drafts) else [])

    def update_from_output(self, plan: StepPlan, result: StepResult) -> EngineOutputs:
        """Apply sampled tokens, finish what is done, and say what happened in one message."""
        trial = [plan.on_trial] if plan.on_trial is not None else []
        if result.fault is not None:
            return EngineOutputs(plan.step_id, self._on_fault(result), trial_over=trial)
        if self._on_probation:
            self._on_probation.difference_update(r.request_id for r in plan.requests)  # passed
        caching = self.config.enable_prefix_caching
        if caching:  # (the sampled ones once their new tokens are known, below)
            skip = {*result.failed_request_ids, *result.request_ids}
            for request in plan.requests:
                if request.request_id not in skip:
                    self._note_computed_blocks(request)
        deltas: list[RequestDelta] = []
        if result.failed_request_ids:
            deltas += self.abort(result.failed_request_ids, RequestEvent.FAIL,
                                 result.error or "the model runner failed")
        prompt_logprobs = {p.request_id: p for p in result.prompt_logprobs}
        num_sampled = len(result.request_ids)
        logprobs = result.logprobs or [None] * num_sampled
        accepted = result.accepted_token_ids or [[]] * num_sampled
        accepted_logprobs = result.accepted_logprobs or [[]] * num_sampled
        proposed = result.spec_token_ids or [[]] * num_sampled
        off_grammar = []
        for i, (request_id, token_id) in enumerate(zip(result.request_ids,
                                                       result.sampled_token_ids)):
            request = self.requests.get(request_id)
            if request is None:
                continue
            new_tokens, reason = self._append_tokens(request, accepted[i] + [token_id])
            if request.grammar is not None and not all(map(request.grammar.accept_token,
                                                           new_tokens)):
                off_grammar.append(request_id)
            if caching:
                self._note_computed_blocks(request)
            if request_id in self._pending_forks:
                self._fork(request)
            new_logprobs = None if logprobs[i] is None else \
                (accepted_logprobs[i] + [logprobs[i]])[:len(new_tokens)]
            positions = self._new_prompt_logprobs(request, prompt_logprobs.pop(request_id, None))
            finish = stop = None
            if reason is not None:
                self.running.remove(request)
                finish = self._finish(request, RequestEvent.FINISH, reason).finish_reason
                stop = request.stop_reason
            else:
                request.spec_token_ids = self._drafts_that_fit(request, proposed[i])
            deltas.append(RequestDelta(request_id, new_tokens, finish, stop, None,
                                       request.num_cached_tokens or 0, new_logprobs, positions))
        for request_id, vector in zip(result.pooled_request_ids, result.pooled):
            if (request := self.requests.get(request_id)) is not None:  # its prompt is pooled
                self.running.remove(request)
                self._finish(request, RequestEvent.FINISH, FinishReason.STOP)
                deltas.append(RequestDelta(request_id, [], FinishReason.STOP.value,
                                           num_cached_tokens=request.num_cached_tokens or 0,
                                           pooled=vector))
        if off_grammar:  # (a runner that ignored the bitmask)
            deltas += self.abort(off_grammar, RequestEvent.FAIL,
                                 "the sampled token does not fit the request's grammar")
        for request_id, chunk in prompt_logprobs.items():  # mid-prefill chunks
            request = self.requests.get(request_id)
            if request is not None and (positions := self._new_prompt_logprobs(request, chunk)):
                deltas.append(RequestDelta(request_id, [], prompt_logprobs=positions))
        return EngineOutputs(plan.step_id, deltas, trial_over=trial)

    # --- internals ----------------------------------------------------------------------------

    def _propose(self, plan: StepPlan, request: Request, budget: int) -> int:
        """Offer a waiting request to the allocator; returns the tokens it may compute."""
        num_tokens = min(self._capped(request.num_tokens - request.num_computed_tokens), budget)
        if self.config.enable_prefix_caching:
            self._hash_full_blocks(request)
        plan.candidates.append((request, num_tokens))
        return num_tokens

    def _capped(self, num_tokens: int) -> int:
        """A request's tokens owed, cut to ``long_prefill_token_threshold`` (vLLM's rule: a
        long prefill takes that many a step, leaving the budget's rest to the others)."""
        threshold = self.config.long_prefill_token_threshold
        return threshold if 0 < threshold < num_tokens else num_tokens

    def _admit(self, request: Request, admitted: Admitted) -> None:
        self.waiting.remove(request)
        # computed from the hit on: the transition's record shows where it starts
        request.num_computed_tokens = admitted.num_cached_tokens
        request.num_cached_blocks = admitted.num_cached_tokens // self.config.block_size
        request.num_blocks = sum(map(len, admitted.block_ids))
        if request.num_cached_tokens is None:
            request.num_cached_tokens = admitted.num_cached_tokens
        request.fire(RequestEvent.SCHEDULE)
        start_running(self.running, request, self.waiting.by_priority)

    def _add_to_step(self, plan: StepPlan, request: Request, num_tokens: int) -> None:
        plan.requests.append(request)
        plan.num_scheduled_tokens.append(num_tokens)
        request.num_computed_tokens += num_tokens
        self.num_scheduled_tokens += num_tokens
        num_decoded = 1 + len(request.spec_token_ids)  # its newest token and the drafts after it
        is_decode = num_tokens == num_decoded and bool(request.output_token_ids) and \
            request.num_computed_tokens == request.num_tokens_with_spec
        plan.is_prefill.append(not is_decode)
        self.num_prefill_tokens += num_tokens - is_decode * num_decoded

    def _append_tokens(self, request: Request, tokens: list[int]
                       ) -> tuple[list[int], FinishReason | None]:
        """Append a step's output of ``request`` (its accepted drafts, then the token drawn
        after them) up to the first that finishes it; the tokens kept and why it finished.
        The KV of rejected drafts is not computed any more: they are past its computed count
        (and never reach the prefix cache, which takes computed blocks only)."""
        if num_drafts := len(request.spec_token_ids):
            num_accepted = len(tokens) - 1
            request.num_computed_tokens -= num_drafts - num_accepted
            self.spec_decoding.observe(num_drafts, num_accepted)
            request.spec_token_ids = []
        reason = None
        for n, token in enumerate(tokens, 1):
            request.output_token_ids.append(token)
            if (reason := self._check_stop(request)) is not None:
                tokens = tokens[:n]
                # (a stop among the accepted drafts: the drafts after it are no tokens of it)
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                break
        return tokens, reason

    def _drafts_that_fit(self, request: Request, drafts: list[int]) -> list[int]:
        """Proposed drafts, cut to what its length caps leave (a step verifies positions
        num_tokens - 1 on, and yields one token more than it has drafts)."""
        if not drafts or request.grammar is not None:
            return []
        room = self.config.max_model_len - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - len(request.output_token_ids) - 1)
        return drafts[:max(0, room)]

    def _note_computed_blocks(self, request: Request) -> None:
        """Blocks whose KV the step completed go to the prefix cache with the next message."""
        num_full = request.num_computed_tokens // self.config.block_size
        if num_full > request.num_cached_blocks:
            hashes = self._hash_full_blocks(request)
            self._computed_blocks.append(ComputedBlocks(
                request.request_id, request.num_cached_blocks,
                hashes[request.num_cached_blocks:num_full]))
            request.num_cached_blocks = num_full

    def _hash_full_blocks(self, request: Request) -> list[int]:
        """The request's block hashes, extended to its full blocks (a waiting request is
        proposed every step: its tokens are copied only when a block has filled since)."""
        if len(request.block_hashes) < request.num_tokens // self.config.block_size:
            extend_block_hashes(request.block_hashes, request.all_token_ids,
                                self.config.block_size, request.block_hash_keys)
        return request.block_hashes

    def _release(self, request: Request) -> None:
        self._to_free.append(request.request_id)
        self._forget_on_workers(request)

    def _forget_on_workers(self, request: Request) -> None:
        if request.is_known_to_workers:
            self._dropped_by_workers.append(request.request_id)
        request.is_known_to_workers = False
        request.num_blocks = request.num_cached_blocks = 0

    def _preempt(self, request: Request, plan: StepPlan | None = None,
                 release: bool = True) -> None:
        """Back to the waiting queue, to be recomputed. ``release``: False when
        the allocator preempted it and has released its blocks already."""
        self.running.remove(request)
        request.fire(RequestEvent.PREEMPT)
        request.spec_token_ids = []  # proposed for where it was; it starts again
        if release:
            self._release(request)
        else:
            self._forget_on_workers(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.put_back(request)
        if plan is not None:
            plan.preempted_ids.append(request.request_id)

    def _on_fault(self, result: StepResult) -> list[RequestDelta]:
        """The step did not happen and the workers lost every request: recompute them all,
        and count the fault against the step's requests."""
        for request in reversed(list(self.running)):  # last first: waiting keeps their order
            self._preempt(request)
        # the replacement workers start with empty KV: nothing cached is there any more
        self._computed_blocks, self._reset_prefix_cache = [], True
        blamed = [self.requests[rid] for rid in result.blame_request_ids if rid in self.requests]
        culprits = []
        for request in blamed:
            request.num_faults += 1
            alone_on_probation = len(blamed) == 1 and request.request_id in self._on_probation
            if alone_on_probation or request.num_faults >= MAX_FAULTS:
                culprits.append(request.request_id)
            elif request.num_faults >= PROBATION_AFTER:
                self._on_probation.add(request.request_id)
        return self.abort(culprits, RequestEvent.FAIL,
                          f"the model runner faults on this request: {result.fault}")

    def _finish(self, request: Request, event: RequestEvent, reason: FinishReason) -> RequestDelta:
        request.finish_reason = reason  # part of the transition: its listeners read it
        request.fire(event)
        self._release(request)
        del self.requests[request.request_id]
        self._on_probation.discard(request.request_id)
        self.num_finished += 1
        return RequestDelta(request.request_id, [], reason.value, request.stop_reason,
                            request.error, error_field=request.error_field)

    def _check_stop(self, request: Request) -> FinishReason | None:
        """vLLM's order: length caps, a grammar that is complete, then (past min_tokens) EOS,
        then stop token ids."""
        params, num_output = request.sampling_params, len(request.output_token_ids)
        if request.num_tokens >= self.config.max_model_len or (
                params.max_tokens is not None and num_output >= params.max_tokens):
            return FinishReason.LENGTH
        if request.grammar is not None and request.grammar.is_terminated():
            return FinishReason.STOP  # the grammar allows nothing more
        if num_output < params.min_tokens:
            return None
        token_id = request.output_token_ids[-1]
        if not params.ignore_eos and token_id in self.config.eos_token_ids:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return FinishReason.STOP
        return None

    def _fork(self, leader: Request) -> None:
        """The leader has prefilled the prompt: its siblings queue ahead (``put_back``) and find
        the prompt's full blocks in the prefix cache (they compute only the partial last one)."""
        for child in reversed(self._pending_forks.pop(leader.request_id)):
            self.waiting.put_back(child)

    def on_grammar(self, request_id: str, grammar, error: str | None) -> list[RequestDelta]:
        """A request's grammar is compiled (it may now be admitted) or failed (so does it)."""
        request = self.requests.get(request_id)
        if request is None:
            return []  # finished while it compiled
        if error is not None:
            return self.abort([request_id], RequestEvent.FAIL, error,
                              error_field="structured_outputs")
        request.grammar, request.awaiting_grammar = new_matcher(grammar), False
        return []

    def _release_pending_forks(self, leader: Request) -> None:
        """A leader that ends before its prefill leaves its siblings to prefill on their own."""
        for child in reversed(self._pending_forks.pop(leader.request_id, [])):
            self.waiting.put_back(child)

    def _new_prompt_logprobs(self, request: Request, chunk: PromptLogprobs | None):
        """Prompt logprobs not delivered before (a recompute after preemption repeats them)."""
        if chunk is None:
            return None
        fresh = chunk.positions[max(0, request.num_prompt_logprobs_sent + 1 - chunk.start):]
        request.num_prompt_logprobs_sent = max(request.num_prompt_logprobs_sent,
                                               chunk.start + len(chunk.positions) - 1)
        return fresh or None

    def _new_request_data(self, request: Request, block_ids: list[list[int]]) -> NewRequestData:
        return NewRequestData(request.request_id, request.all_token_ids, request.num_prompt_tokens,
                              block_ids, request.num_computed_tokens, request.sampling_params,
                              request.seed, request.bad_words_token_ids,
                              request.lora_request, request.pooling_params)


def _lora_names(requests: Iterable[Request]) -> list[str]:
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
