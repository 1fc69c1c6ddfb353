"""The scheduling policy: which requests compute how many tokens in the next step.

Design (vLLM V1's token-debt model). There is no prefill or decode phase: every request owes
``num_tokens - num_computed_tokens`` tokens, and each step pays down as much debt as the token
budget (``max_num_batched_tokens``), the sequence cap (``max_num_seqs``) and the free KV blocks
allow. Running requests are served first, in arrival order, so decodes are never starved by a
new prompt; a long prompt is split across steps (chunked prefill). When a running request needs
a block and none is free, the newest running request is preempted: its blocks are released,
its computed tokens reset, and it returns to the front of the waiting queue to be recomputed
later — which yields the same greedy tokens. No waiting request is admitted in a step that
preempted, since admitting one would only take blocks back from the victims.

A worker fault loses no request: the step did not happen and the workers forgot every request,
so every running request is preempted and recomputed. To tell a request that makes the worker
fault (a poison request) from the ones batched with it, a request in ``PROBATION_AFTER``
faulted steps is put on probation: it runs alone until one step of it succeeds. It fails when
it faults alone, or after ``MAX_FAULTS`` faulted steps in any company; no other request does.

The policy is pure and thread-free. It plans against ``num_free_blocks`` — the allocator's last
report plus the blocks this scheduler has released since — so the allocator's grant for the
step never fails. Aborts are applied only between steps (the actor defers them while a step is
in flight), so a step's requests never change under it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from actorlm.core.request import Request
from actorlm.fsm import FinishReason, RequestEvent, RequestState
from actorlm.fsm.machine import Listener
from actorlm.messages import (AddRequest, AllocateSlots, CachedRequestData, EngineOutputs,
                              NewRequestData, PromptLogprobs, RequestDelta, ScheduleStep,
                              SlotsGranted, StepResult, child_request_id)


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


@dataclass
class StepPlan:
    """What ``schedule()`` decided; becomes one AllocateSlots, then one ScheduleStep."""

    step_id: int
    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    free_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    shares: list[tuple[str, list[int]]] = field(default_factory=list)

    def allocate_message(self) -> AllocateSlots:
        return AllocateSlots(self.step_id, self.free_request_ids,
                             [r.request_id for r in self.requests], self.num_new_blocks,
                             [rid for rid, _ in self.shares], [ids for _, ids in self.shares])


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_total_blocks: int,
                 listeners: Iterable[Listener] = ()):
        self.config = config
        self.listeners = list(listeners)
        self.requests: dict[str, Request] = {}  # every live (unfinished) request
        self.waiting: deque[Request] = deque()  # WAITING and PREEMPTED, front first
        self.running: list[Request] = []  # admission order: the last is preempted first
        self.num_total_blocks = num_total_blocks
        self.num_free_blocks = num_total_blocks
        self._to_free: list[str] = []  # released since the last AllocateSlots
        self._to_share: list[tuple[str, list[int]]] = []  # forked since the last AllocateSlots
        # n > 1: children wait here until their leader (child 0) has prefilled the prompt
        self._pending_forks: dict[str, list[Request]] = {}
        # blocks held by two or more live requests -> number of holders (the planning view;
        # the allocator's reference counts stay the truth)
        self._num_holders: dict[int, int] = {}
        self._dropped_by_workers: list[str] = []  # finished or preempted since the last step
        self._on_probation: set[str] = set()  # run alone until one step of theirs succeeds
        self._next_step_id = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_scheduled_tokens = 0

    # --- intake -------------------------------------------------------------------------------

    def add_request(self, msg: AddRequest) -> None:
        """Queue a validated request (FCFS); ``n > 1`` queues its first child, the others
        follow once it has prefilled the prompt they share."""
        n = msg.sampling_params.n
        ids = [msg.request_id] if n == 1 else [child_request_id(msg.request_id, i) for i in range(n)]
        if taken := [rid for rid in ids if rid in self.requests]:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        children = [Request(rid, msg.prompt_token_ids, msg.sampling_params,
                            (msg.seed + i) % (1 << 63), msg.arrival_time, self.listeners,
                            msg.bad_words_token_ids) for i, rid in enumerate(ids)]
        for request in children:
            self.requests[request.request_id] = request
        self.waiting.append(children[0])
        if n > 1:
            self._pending_forks[children[0].request_id] = children[1:]

    def abort(self, request_ids: Iterable[str], event=RequestEvent.ABORT,
              error: str | None = None, stop_reasons: Iterable[str] | None = None
              ) -> list[RequestDelta]:
        """Finish the given live requests (unknown or finished ids are ignored). Between steps
        only. ``event`` FINISH with ``stop_reasons`` finishes them as stopped (stop strings)."""
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
            request.error, request.stop_reason = error, stop_reason
            self._release_pending_forks(request)
            deltas.append(self._finish(request, event, reason))
        return deltas

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- one step -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan the next step; None when there is nothing to compute and nothing to free."""
        cfg = self.config
        plan = StepPlan(self._next_step_id)
        budget = cfg.max_num_batched_tokens

        if self._on_probation:  # (empty unless a worker has faulted)
            suspect = next((r for r in self.waiting if r.request_id in self._on_probation), None)
            if suspect is not None:
                self._plan_alone(plan, suspect, budget)
                budget = 0

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            num_blocks = self._num_new_blocks(request, num_tokens)
            while num_blocks > self.num_free_blocks and request in self.running:
                self._preempt(self.running[-1], plan)
            if request not in self.running:
                break  # it was the newest and had to go itself
            self._add_to_plan(plan, request, num_tokens, num_blocks)
            budget -= num_tokens
            index += 1

        while (self.waiting and not plan.preempted_ids and budget > 0
               and len(self.running) < cfg.max_num_seqs):
            request = self.waiting[0]
            num_tokens = request.num_tokens - request.num_computed_tokens
            if num_tokens > budget and not cfg.enable_chunked_prefill:
                break
            num_tokens = min(num_tokens, budget)
            num_blocks = self._num_new_blocks(request, num_tokens)
            if num_blocks > self.num_free_blocks:
                break
            self.waiting.popleft()
            request.fire(RequestEvent.SCHEDULE)
            self.running.append(request)
            self._add_to_plan(plan, request, num_tokens, num_blocks)
            budget -= num_tokens

        plan.free_request_ids, self._to_free = self._to_free, []
        plan.shares, self._to_share = self._to_share, []
        if not plan.requests and not plan.free_request_ids and not plan.shares:
            return None
        self._next_step_id += 1
        return plan

    def on_slots_granted(self, plan: StepPlan, granted: SlotsGranted) -> ScheduleStep | None:
        """Turn a granted plan into the step message (None for a plan that only freed blocks)."""
        # nothing is released between a plan and its grant, so the allocator's count is ours
        self.num_free_blocks = granted.num_free_blocks
        new, cached = [], []
        for request, num_tokens, block_ids in zip(plan.requests, plan.num_scheduled_tokens,
                                                  granted.new_block_ids):
            request.block_ids.extend(block_ids)
            if request.is_known_to_workers:
                cached.append(CachedRequestData(request.request_id, block_ids,
                                                request.num_computed_tokens))
            else:
                new.append(self._new_request_data(request))
                request.is_known_to_workers = True
            request.num_computed_tokens += num_tokens
            self.num_scheduled_tokens += num_tokens
        dropped, self._dropped_by_workers = self._dropped_by_workers, []
        if not plan.requests:
            self._dropped_by_workers = dropped  # nothing runs: tell the workers next time
            return None
        # new requests first, then cached: num_scheduled_tokens follows that order
        order = {r.request_id: n for r, n in zip(plan.requests, plan.num_scheduled_tokens)}
        counts = [order[d.request_id] for d in new] + [order[d.request_id] for d in cached]
        return ScheduleStep(plan.step_id, new, cached, counts, dropped)

    def update_from_output(self, plan: StepPlan, result: StepResult) -> EngineOutputs:
        """Apply sampled tokens, finish what is done, and say what happened in one message."""
        if result.fault is not None:
            return EngineOutputs(plan.step_id, self._on_fault(result))
        if self._on_probation:
            self._on_probation.difference_update(r.request_id for r in plan.requests)  # passed
        deltas: list[RequestDelta] = []
        if result.failed_request_ids:
            deltas += self.abort(result.failed_request_ids, RequestEvent.FAIL,
                                 result.error or "the model runner failed")
        prompt_logprobs = {p.request_id: p for p in result.prompt_logprobs}
        logprobs = result.logprobs or [None] * len(result.request_ids)
        for request_id, token_id, token_logprobs in zip(result.request_ids,
                                                        result.sampled_token_ids, logprobs):
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.output_token_ids.append(token_id)
            if request_id in self._pending_forks:
                self._fork(request)
            new_logprobs = [token_logprobs] if token_logprobs is not None else None
            positions = self._new_prompt_logprobs(request, prompt_logprobs.pop(request_id, None))
            reason = self._check_stop(request)
            finish = stop = None
            if reason is not None:
                self.running.remove(request)
                finish = self._finish(request, RequestEvent.FINISH, reason).finish_reason
                stop = request.stop_reason
            deltas.append(RequestDelta(request_id, [token_id], finish, stop, None,
                                       0, new_logprobs, positions))
        for request_id, chunk in prompt_logprobs.items():  # mid-prefill chunks
            request = self.requests.get(request_id)
            if request is not None and (positions := self._new_prompt_logprobs(request, chunk)):
                deltas.append(RequestDelta(request_id, [], prompt_logprobs=positions))
        return EngineOutputs(plan.step_id, deltas)

    # --- internals ----------------------------------------------------------------------------

    def _num_new_blocks(self, request: Request, num_tokens: int) -> int:
        needed = -(-(request.num_computed_tokens + num_tokens) // self.config.block_size)
        return max(0, needed - len(request.block_ids))

    def _add_to_plan(self, plan: StepPlan, request: Request, num_tokens: int, num_blocks: int):
        plan.requests.append(request)
        plan.num_scheduled_tokens.append(num_tokens)
        plan.num_new_blocks.append(num_blocks)
        self.num_free_blocks -= num_blocks

    def _release(self, request: Request) -> None:
        for block_id in request.block_ids:
            holders = self._num_holders.get(block_id)
            if holders is None:
                self.num_free_blocks += 1
            elif holders > 2:
                self._num_holders[block_id] = holders - 1
            else:
                del self._num_holders[block_id]  # one holder left: no longer shared
        self._to_free.append(request.request_id)
        if request.is_known_to_workers:
            self._dropped_by_workers.append(request.request_id)
        request.block_ids = []
        request.is_known_to_workers = False

    def _preempt(self, request: Request, plan: StepPlan | None = None) -> None:
        self.running.remove(request)
        request.fire(RequestEvent.PREEMPT)
        self._release(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        if plan is not None:
            plan.preempted_ids.append(request.request_id)

    def _plan_alone(self, plan: StepPlan, request: Request, budget: int) -> None:
        """A request on probation runs alone, making room by preempting the newest runners."""
        num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
        num_blocks = self._num_new_blocks(request, num_tokens)
        while self.running and (num_blocks > self.num_free_blocks or
                                len(self.running) >= self.config.max_num_seqs):
            self._preempt(self.running[-1], plan)
        if num_blocks > self.num_free_blocks:
            return  # blocks still on their way back; the next plan has them
        self.waiting.remove(request)
        request.fire(RequestEvent.SCHEDULE)
        self.running.append(request)
        self._add_to_plan(plan, request, num_tokens, num_blocks)

    def _on_fault(self, result: StepResult) -> list[RequestDelta]:
        """The step did not happen and the workers lost every request: recompute them all,
        and count the fault against the step's requests."""
        for request in reversed(list(self.running)):  # newest first: waiting keeps their order
            self._preempt(request)
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
        request.fire(event)
        request.finish_reason = reason
        self._release(request)
        del self.requests[request.request_id]
        self._on_probation.discard(request.request_id)
        self.num_finished += 1
        return RequestDelta(request.request_id, [], reason.value, request.stop_reason,
                            request.error)

    def _check_stop(self, request: Request) -> FinishReason | None:
        """vLLM's order: length caps, then (past min_tokens) EOS, then stop token ids."""
        params, num_output = request.sampling_params, len(request.output_token_ids)
        if request.num_tokens >= self.config.max_model_len or (
                params.max_tokens is not None and num_output >= params.max_tokens):
            return FinishReason.LENGTH
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
        """The leader has prefilled the prompt: its siblings share the prompt's full blocks and
        recompute only the partial last block (fewer than block_size tokens each)."""
        num_shared = (leader.num_prompt_tokens - 1) // self.config.block_size
        shared = leader.block_ids[:num_shared]
        children = self._pending_forks.pop(leader.request_id)
        for child in reversed(children):
            child.block_ids = list(shared)
            child.num_computed_tokens = num_shared * self.config.block_size
            self.waiting.appendleft(child)
            if shared:
                self._to_share.append((child.request_id, shared))
        for block_id in shared:
            self._num_holders[block_id] = self._num_holders.get(block_id, 1) + len(children)

    def _release_pending_forks(self, leader: Request) -> None:
        """A leader that ends before its prefill leaves its siblings to prefill on their own."""
        for child in reversed(self._pending_forks.pop(leader.request_id, [])):
            self.waiting.appendleft(child)

    def _new_prompt_logprobs(self, request: Request, chunk: PromptLogprobs | None):
        """Prompt logprobs not delivered before (a recompute after preemption repeats them)."""
        if chunk is None:
            return None
        fresh = chunk.positions[max(0, request.num_prompt_logprobs_sent + 1 - chunk.start):]
        request.num_prompt_logprobs_sent = max(request.num_prompt_logprobs_sent,
                                               chunk.start + len(chunk.positions) - 1)
        return fresh or None

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(request.request_id, request.all_token_ids, request.num_prompt_tokens,
                              list(request.block_ids), request.num_computed_tokens,
                              request.sampling_params, request.seed, request.bad_words_token_ids)
