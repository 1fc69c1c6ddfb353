"""FakeModelRunner: ``ModelRunner.execute(step) -> StepResult`` without a model.

It keeps the same cached request state as the real runner (new requests arrive in full, cached
ones as deltas, ``finished_request_ids`` are dropped before the step runs) and samples by the
same rule: a request samples exactly when the step completes its context. The token it
"samples" is a pure function of the request and the position — by default of the prompt's
tokens and the position (and the seed, for temperature > 0) — so a request that is preempted
and recomputed, split into other chunks or batched with other requests produces exactly the
same tokens, as greedy decoding on a real model does.

It is also an oracle. It simulates the paged KV cache at the level of "which token at which
position sits in which slot", and checks on every step that each request's context is where
its block tables say it is; that its computed-token count agrees with the scheduler's; that it
has enough blocks; that a cached request is known and a new one is not. With KV-cache groups
(``windows``: one per group, None for full attention) it keeps a table per group, writes each
token in every group's block, and reads back what each group's attention would read: all
earlier positions for a full group, the last W for a sliding one; with a sliding group, block
0 is the allocator's placeholder and must never be written. One slot space serves all groups,
as one pool of block ids does. A violation is recorded
in ``violations`` and fails the step (as a fault would), so the engine stays up while the test
that reads ``violations`` (``EngineHarness`` does after every step) fails loudly.

Time: each step advances the given clock by ``step_latency`` (seconds, or a function of the
step), so latency is simulated without sleeping. ``fail_request(id)`` fails one request while
the others of the step get their tokens; whole-step faults and dying workers come from wrapping
any runner in ``actorlm.testing.FaultInjector``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

from actorlm.hashing import GOLDEN_GAMMA, mix64
from actorlm.messages import ScheduleStep, StepResult


TokenFn = Callable[[Sequence[int], int, int], int]
"""token_fn(prompt_token_ids, position, seed) -> token id sampled at ``position``."""


class InjectedFault(RuntimeError):
    """A fault a test asked for (``fail_request``, ``FaultInjector``)."""


def _mix(x: int) -> int:
    return mix64(x + GOLDEN_GAMMA)


def prompt_digest(prompt_token_ids: Sequence[int]) -> int:
    h = len(prompt_token_ids)
    for token in prompt_token_ids:
        h = _mix(h ^ token)
    return h


@dataclass
class _State:
    request_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    block_tables: list[list[int]]  # one per KV-cache group
    num_computed_tokens: int
    seed: int  # 0 for greedy requests: their tokens do not depend on it
    digest: int = 0


@dataclass
class _RequestFault:
    error: str
    num_times: int


@dataclass
class FakeStepLog:
    """What the fake saw in one step (kept in ``FakeModelRunner.steps``)."""

    step_id: int
    index: int  # 0-based count of executed steps
    request_ids: list[str]
    num_scheduled_tokens: list[int]
    sampled: dict[str, int] = field(default_factory=dict)
    failed_request_ids: list[str] = field(default_factory=list)
    error: str | None = None


class FakeModelRunner:
    """A deterministic stand-in for ``actorlm.models.runner.ModelRunner``.

    ``vocab_size``: tokens are drawn from ``[first_token_id, vocab_size)`` by the default
    ``token_fn``. ``block_size`` / ``num_blocks``: enable the KV-cache checks (None disables
    them). ``windows``: the KV-cache groups' windows (None: full attention), as the block pool
    has them. ``clock`` + ``step_latency``: simulated time per step.
    """

    def __init__(self, *, vocab_size: int = 1000, block_size: int | None = None,
                 num_blocks: int | None = None, token_fn: TokenFn | None = None,
                 first_token_id: int = 10, clock=None,
                 step_latency: float | Callable[[ScheduleStep], float] = 0.0,
                 windows: Sequence[int | None] = (None,)):
        if not 0 <= first_token_id < vocab_size:
            raise ValueError(f"first_token_id {first_token_id} is outside [0, {vocab_size})")
        self.vocab_size, self.first_token_id = vocab_size, first_token_id
        self.block_size, self.num_blocks = block_size, num_blocks
        self.windows = tuple(windows)
        self._has_placeholder = any(w is not None for w in self.windows)
        self.token_fn = token_fn
        self.clock, self.step_latency = clock, step_latency
        self.requests: dict[str, _State] = {}  # the cached request state
        self.steps: list[FakeStepLog] = []
        self.violations: list[str] = []
        self._kv: dict[int, tuple[int, int]] = {}  # slot -> (token id, position) written there
        self._request_faults: dict[str, _RequestFault] = {}
        self._lock = threading.Lock()  # faults are armed from the test thread

    # --- the model ----------------------------------------------------------------------------

    def token_at(self, prompt_token_ids: Sequence[int], position: int, seed: int = 0) -> int:
        """The token this fake samples at ``position`` (>= len(prompt)) after that prompt."""
        if self.token_fn is not None:
            return int(self.token_fn(prompt_token_ids, position, seed))
        return self._default_token(prompt_digest(prompt_token_ids), position, seed)

    def expected_tokens(self, prompt_token_ids: Sequence[int], num_tokens: int,
                        seed: int = 0) -> list[int]:
        """The first ``num_tokens`` tokens a request with this prompt generates (the oracle)."""
        n = len(prompt_token_ids)
        return [self.token_at(prompt_token_ids, n + i, seed) for i in range(num_tokens)]

    def _default_token(self, digest: int, position: int, seed: int) -> int:
        span = self.vocab_size - self.first_token_id
        return self.first_token_id + _mix(digest ^ _mix(position) ^ _mix(seed + 1)) % span

    def _sample(self, state: _State, position: int) -> int:
        if self.token_fn is not None:
            return int(self.token_fn(state.token_ids[:state.num_prompt_tokens], position,
                                     state.seed))
        return self._default_token(state.digest, position, state.seed)

    # --- fault injection ----------------------------------------------------------------------

    def fail_request(self, request_id: str, error: str = "injected fault",
                     num_times: int = 1) -> None:
        """Fail ``request_id`` in the next ``num_times`` steps that schedule it: it is reported
        in ``failed_request_ids`` and forgotten, while the step's other requests get tokens."""
        with self._lock:
            self._request_faults[request_id] = _RequestFault(error, num_times)

    def fresh(self) -> FakeModelRunner:
        """This fake as a newly built worker gets it: no request and nothing in the KV cache,
        as after a worker is replaced (its step log and ``violations`` carry on)."""
        self.requests.clear()
        self._kv.clear()
        return self

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    # --- one step -----------------------------------------------------------------------------

    def execute(self, step: ScheduleStep) -> StepResult:
        """Run one step: same message contract as ``ModelRunner.execute``."""
        log = FakeStepLog(step.step_id, len(self.steps), [], list(step.num_scheduled_tokens))
        self.steps.append(log)
        if self.clock is not None:
            latency = self.step_latency(step) if callable(self.step_latency) else self.step_latency
            if latency:
                self.clock.advance(latency)
        problems: list[str] = []
        for request_id in step.finished_request_ids:
            self._drop(request_id)
        for data in step.new_requests:
            if data.request_id in self.requests:
                problems.append(f"{data.request_id}: sent in full but the worker still holds it "
                                f"(missing from finished_request_ids)")
            seed = 0 if data.sampling_params.is_greedy else data.seed
            if data.block_ids and len(data.block_ids) != len(self.windows):
                problems.append(f"{data.request_id}: {len(data.block_ids)} block tables for "
                                f"{len(self.windows)} KV-cache groups")
                continue
            tables = [list(table) for table in data.block_ids] or [[] for _ in self.windows]
            state = _State(data.request_id, list(data.token_ids), data.num_prompt_tokens,
                           tables, data.num_computed_tokens, seed,
                           prompt_digest(data.token_ids[:data.num_prompt_tokens]))
            self.requests[data.request_id] = state
            for p in range(state.num_prompt_tokens, len(state.token_ids)):  # a recompute
                if state.token_ids[p] != self._sample(state, p):
                    problems.append(f"{data.request_id}: output token at position {p} is "
                                    f"{state.token_ids[p]}, but this model produced "
                                    f"{self._sample(state, p)} there")
                    break
        for delta in step.cached_requests:
            state = self.requests.get(delta.request_id)
            if state is None:
                problems.append(f"{delta.request_id}: cached request unknown to the worker")
                continue
            if delta.num_computed_tokens != state.num_computed_tokens:
                problems.append(f"{delta.request_id}: scheduler says {delta.num_computed_tokens} "
                                f"tokens computed, the worker has {state.num_computed_tokens}")
            if delta.new_block_ids and len(delta.new_block_ids) != len(self.windows):
                problems.append(f"{delta.request_id}: new blocks for {len(delta.new_block_ids)} "
                                f"KV-cache groups, the model has {len(self.windows)}")
                continue
            for table, new_ids in zip(state.block_tables, delta.new_block_ids):
                table.extend(new_ids)
            state.num_computed_tokens = delta.num_computed_tokens
        request_ids = [d.request_id for d in step.new_requests] + \
                      [d.request_id for d in step.cached_requests]
        log.request_ids = request_ids
        if len(request_ids) != len(step.num_scheduled_tokens):
            problems.append(f"{len(request_ids)} requests but "
                            f"{len(step.num_scheduled_tokens)} token counts")
        if problems:
            self.violations += [f"step {step.step_id}: {p}" for p in problems]
            return self._fail_all(step, log, request_ids, "; ".join(problems))

        failed, failure_errors = self._take_request_faults(request_ids)
        result_ids, tokens = [], []
        for request_id, n in zip(request_ids, step.num_scheduled_tokens):
            state = self.requests[request_id]
            if request_id in failed:
                self._drop(request_id)
                continue
            problem = self._compute(state, n)
            if problem:
                self.violations.append(f"step {step.step_id}: {request_id}: {problem}")
                failed.append(request_id)
                failure_errors.append(f"{request_id}: {problem}")
                self._drop(request_id)
                continue
            if state.num_computed_tokens == len(state.token_ids):  # context complete: sample
                token = self._sample(state, len(state.token_ids))
                state.token_ids.append(token)
                result_ids.append(request_id)
                tokens.append(token)
                log.sampled[request_id] = token
        log.failed_request_ids = failed
        log.error = "; ".join(failure_errors) or None
        return StepResult(step.step_id, result_ids, tokens, log.error, failed)

    # --- internals ----------------------------------------------------------------------------

    def _compute(self, state: _State, n: int) -> str | None:
        """Advance ``state`` by ``n`` tokens, writing and reading the simulated KV cache."""
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        if n <= 0:
            return f"scheduled {n} tokens"
        if end > len(state.token_ids):
            return f"scheduled up to position {end} but only {len(state.token_ids)} tokens exist"
        if self.block_size is not None:
            for group, (table, window) in enumerate(zip(state.block_tables, self.windows)):
                problem = self._compute_group(state, table, window, start, end)
                if problem:
                    return problem if len(self.windows) == 1 else f"group {group}: {problem}"
        state.num_computed_tokens = end
        return None

    def _compute_group(self, state: _State, table: list[int], window: int | None, start: int,
                       end: int) -> str | None:
        """One KV-cache group's writes of positions [start, end) and the reads of its
        attention: every earlier position, or those within the window of the first query."""
        bs = self.block_size
        if len(table) * bs < end:
            return f"{len(table)} blocks of {bs} cannot hold {end} tokens"
        if self.num_blocks is not None:
            bad = [b for b in table if not 0 <= b < self.num_blocks]
            if bad:
                return f"block id {bad[0]} is outside the pool of {self.num_blocks}"
        for p in range(start, end):  # write this step's K/V
            if self._has_placeholder and table[p // bs] == 0:
                return f"position {p} is written into block 0, the placeholder"
            self._kv[table[p // bs] * bs + p % bs] = (state.token_ids[p], p)
        first_read = 0 if window is None else max(0, start - window + 1)
        for p in range(first_read, start):  # attention reads the context through the table
            found = self._kv.get(table[p // bs] * bs + p % bs)
            if found != (state.token_ids[p], p):
                return (f"position {p} reads slot {table[p // bs] * bs + p % bs} holding "
                        f"{found} (token, position), expected {(state.token_ids[p], p)}")
        return None

    def _take_request_faults(self, request_ids: list[str]) -> tuple[list[str], list[str]]:
        failed, errors = [], []
        with self._lock:
            for request_id in request_ids:
                fault = self._request_faults.get(request_id)
                if fault is None:
                    continue
                failed.append(request_id)
                errors.append(f"{InjectedFault.__name__}: {fault.error} ({request_id})")
                fault.num_times -= 1
                if fault.num_times <= 0:
                    del self._request_faults[request_id]
        return failed, errors

    def _fail_all(self, step: ScheduleStep, log: FakeStepLog, request_ids: list[str],
                  error: str) -> StepResult:
        for request_id in request_ids:
            self._drop(request_id)
        log.failed_request_ids, log.error = list(request_ids), error
        return StepResult(step.step_id, [], [], error, list(request_ids))

    def _drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
