"""The scheduling policy driven by hand, with a block pool in-process and fake model outputs."""

import itertools
import random

import pytest

from actorlm.core.block_pool import BlockPool
from actorlm.core.scheduler import Scheduler, SchedulerConfig
from actorlm.fsm import RequestState
from actorlm.messages import AddRequest, StepResult
from actorlm.sampling_params import SamplingParams


def fake_token(token_ids: list[int]) -> int:
    """A deterministic 'model': the next token depends only on the tokens so far."""
    return (sum(t * (i + 1) for i, t in enumerate(token_ids)) * 31 + 7) % 97 + 3


class Driver:
    def __init__(self, num_blocks=64, block_size=4, budget=32, max_seqs=8, max_model_len=64,
                 chunked=True, eos=2, caching=True, policy="fcfs", long_prefill=0):
        cfg = SchedulerConfig(budget, max_seqs, max_model_len, block_size, chunked,
                              frozenset({eos}), caching, scheduling_policy=policy,
                              long_prefill_token_threshold=long_prefill)
        self.scheduler = Scheduler(cfg)
        self._arrivals = itertools.count()
        self.pool = BlockPool(num_blocks, block_size, caching)
        self.plans, self.outputs, self.running_before = [], {}, []

    def add(self, request_id, prompt_len, max_tokens=8, priority=0, **params):
        rng = random.Random(request_id)  # the same prompt in every process (hash() is salted)
        prompt = [rng.randrange(5, 95) for _ in range(prompt_len)]
        self.scheduler.add_request(AddRequest(request_id, prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0, **params), 0, float(next(self._arrivals)),
            priority=priority))

    def first_steps(self) -> list[str]:
        """Request ids in the order they were first scheduled."""
        return list(dict.fromkeys(r.request_id for p in self.plans for r in p.requests))

    def step(self):
        before = {r.request_id for r in self.scheduler.running}
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        granted = self.pool.grant(plan.allocate_message(self.scheduler.config.block_size))
        self.scheduler.on_slots_granted(plan, granted)
        result = self.result_of(plan)
        for delta in self.scheduler.update_from_output(plan, result).deltas:
            out = self.outputs.setdefault(delta.request_id, [[], None])
            out[0] += delta.new_token_ids
            out[1] = delta.finish_reason or out[1]
        self.plans.append(plan)
        self.running_before.append(before)
        return plan

    def result_of(self, plan) -> StepResult:
        """What the 'runner' answers: a token for each request whose context is complete."""
        sampled = [r for r in plan.requests if r.num_computed_tokens == r.num_tokens]
        return StepResult(plan.step_id, [r.request_id for r in sampled],
                          [fake_token(r.all_token_ids) for r in sampled])

    def run(self, max_steps=2000):
        for _ in range(max_steps):
            if self.step() is None and not self.scheduler.has_unfinished:
                return self
        raise AssertionError("engine did not become idle")


def test_budgets_hold_every_step_and_nothing_leaks():
    d = Driver(budget=24, max_seqs=3)
    for i in range(7):
        d.add(f"r{i}", prompt_len=5 + 3 * i, max_tokens=6)
    d.run()
    for plan in d.plans:
        assert plan.num_tokens <= 24 and len(plan.requests) <= 3
    assert all(out[1] == "length" and len(out[0]) == 6 for out in d.outputs.values())
    d.scheduler.schedule()  # flush the last frees
    assert d.pool.num_free_blocks == 64 and d.pool.num_requests_holding_blocks == 0


def test_chunked_prefill_splits_a_long_prompt_and_keeps_decoding_others():
    d = Driver(budget=16, max_model_len=128, num_blocks=64)
    d.add("short", prompt_len=4, max_tokens=20)
    d.step()  # short prefills alone
    d.add("long", prompt_len=50, max_tokens=2)
    chunks = []
    while d.scheduler.requests.get("long") and d.scheduler.requests["long"].is_prefilling:
        plan = d.step()
        by_id = dict(zip([r.request_id for r in plan.requests], plan.num_scheduled_tokens))
        assert by_id["short"] == 1  # the decode is served first, every step
        chunks.append(by_id["long"])
    assert chunks == [15, 15, 15, 5]


def test_a_long_prefill_takes_its_threshold_a_step_and_the_rest_starts_beside_it():
    def run(threshold):
        d = Driver(budget=48, max_model_len=128, num_blocks=64, long_prefill=threshold)
        d.add("long", prompt_len=100, max_tokens=4, ignore_eos=True)
        d.add("short", prompt_len=10, max_tokens=4, ignore_eos=True)
        d.run()
        return d, [dict(zip([r.request_id for r in plan.requests], plan.num_scheduled_tokens))
                   for plan in d.plans]

    capped, steps = run(32)
    assert steps[:4] == [{"long": 32, "short": 10}, {"long": 32, "short": 1},
                         {"long": 32, "short": 1}, {"long": 4, "short": 1}]
    uncapped, steps = run(0)  # the budget alone: the short prompt waits two steps behind it
    assert steps[:3] == [{"long": 48}, {"long": 48}, {"long": 4, "short": 10}]
    assert capped.outputs == uncapped.outputs  # the same tokens, in fewer or more steps


def test_preemption_by_recompute_gives_the_same_tokens():
    def run(num_blocks):
        d = Driver(num_blocks=num_blocks, block_size=4, budget=64, max_seqs=8, max_model_len=64)
        for i in range(6):
            d.add(f"r{i}", prompt_len=6 + i, max_tokens=24, ignore_eos=True)
        return d.run()

    roomy, tight = run(64), run(16)
    assert roomy.scheduler.num_preemptions == 0 and tight.scheduler.num_preemptions > 0
    assert tight.outputs == roomy.outputs
    for plan, before in zip(tight.plans, tight.running_before):
        if plan.preempted_ids:  # no waiting request is admitted in a step that preempted
            assert {r.request_id for r in plan.requests} <= before


def test_newest_running_request_is_the_one_preempted():
    d = Driver(num_blocks=6, block_size=4, budget=64, max_model_len=24)
    d.add("old", prompt_len=7, max_tokens=12, ignore_eos=True)
    d.add("new", prompt_len=7, max_tokens=12, ignore_eos=True)
    while not d.scheduler.num_preemptions:
        d.step()
    victim = [p for p in d.plans if p.preempted_ids][0].preempted_ids
    assert victim == ["new"]
    assert d.scheduler.requests["new"].state is RequestState.PREEMPTED


PRIORITIES = {"a": 0, "b": 5, "c": -1, "d": 5, "e": 0}


@pytest.mark.parametrize("policy, order", [("fcfs", "abcde"), ("priority", "caebd")])
def test_requests_start_in_the_policys_order(policy, order):
    d = Driver(max_seqs=1, policy=policy)
    for request_id, priority in PRIORITIES.items():
        d.add(request_id, prompt_len=5, max_tokens=3, priority=priority)
    d.run()
    assert "".join(d.first_steps()) == order  # smaller first; arrival among equals


def test_under_priority_the_lowest_priority_running_request_is_preempted():
    d = Driver(num_blocks=6, block_size=4, budget=64, max_model_len=24, policy="priority")
    d.add("bulk", prompt_len=7, max_tokens=12, ignore_eos=True, priority=2)
    d.step()
    d.add("urgent", prompt_len=7, max_tokens=12, ignore_eos=True, priority=1)  # admitted next
    while not d.scheduler.num_preemptions:
        d.step()
    assert [p for p in d.plans if p.preempted_ids][0].preempted_ids == ["bulk"]  # the older
    assert [r.request_id for r in d.scheduler.running] == ["urgent"]
    d.run()
    assert {rid: len(out[0]) for rid, out in d.outputs.items()} == {"bulk": 12, "urgent": 12}


def test_a_waiting_request_preempts_no_running_one_whatever_its_priority():
    """As in vLLM: a request that outranks the running ones waits for blocks to come free."""
    d = Driver(num_blocks=4, block_size=4, budget=64, max_model_len=16, policy="priority")
    d.add("bulk", prompt_len=13, max_tokens=3, ignore_eos=True, priority=9)  # every block
    d.step()
    d.add("urgent", prompt_len=7, max_tokens=4, ignore_eos=True, priority=-9)
    while "bulk" in d.scheduler.requests:
        d.step()
        assert d.scheduler.num_preemptions == 0
        assert d.scheduler.requests["urgent"].state is RequestState.WAITING
    d.run()
    assert d.first_steps() == ["bulk", "urgent"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_under_either_policy_gives_the_same_tokens_and_leaks_nothing(policy):
    def run(num_blocks):
        d = Driver(num_blocks=num_blocks, block_size=4, budget=64, max_seqs=8, max_model_len=64,
                   policy=policy)
        for i in range(6):
            d.add(f"r{i}", prompt_len=6 + i, max_tokens=24, ignore_eos=True, priority=i % 3)
        return d.run()

    roomy, tight = run(64), run(16)
    assert tight.scheduler.num_preemptions > 0 and tight.outputs == roomy.outputs
    tight.scheduler.schedule()  # flush the last frees
    assert tight.pool.num_free_blocks == 16 and tight.pool.num_requests_holding_blocks == 0


@pytest.mark.parametrize("stop", ["eos", "stop_token", "max_tokens", "max_model_len"])
def test_finish_reasons(stop):
    d = Driver(max_model_len=16)
    prompt_len = 6
    d.add("probe", prompt_len, max_tokens=30, ignore_eos=True)
    tokens = d.run().outputs["probe"][0]  # 10 tokens until max_model_len
    assert len(tokens) == 16 - prompt_len
    d = Driver(max_model_len=16, eos=tokens[3])
    params = {"eos": dict(max_tokens=30), "stop_token": dict(max_tokens=30, ignore_eos=True,
              stop_token_ids=[tokens[3]]), "max_tokens": dict(max_tokens=3, ignore_eos=True),
              "max_model_len": dict(max_tokens=30, ignore_eos=True)}[stop]
    d.add("probe", prompt_len, **params)
    out, reason = d.run().outputs["probe"]
    expected = {"eos": (4, "stop"), "stop_token": (4, "stop"), "max_tokens": (3, "length"),
                "max_model_len": (10, "length")}[stop]
    assert (len(out), reason) == expected and out == tokens[:len(out)]


@pytest.mark.parametrize("when", ["waiting", "running", "preempted"])
def test_abort_in_each_state_frees_every_block(when):
    d = Driver(num_blocks=6, block_size=4, budget=64, max_model_len=24)
    d.add("old", prompt_len=7, max_tokens=12, ignore_eos=True)
    d.add("new", prompt_len=7, max_tokens=12, ignore_eos=True)
    if when == "waiting":
        d.add("late", prompt_len=3)
        target = "late"
    elif when == "running":
        d.step()
        target = "old"
    else:
        while not d.scheduler.num_preemptions:
            d.step()
        target = "new"
    state = {"waiting": RequestState.WAITING, "running": RequestState.RUNNING,
             "preempted": RequestState.PREEMPTED}[when]
    request = d.scheduler.requests[target]
    assert request.state is state
    deltas = d.scheduler.abort([target])
    assert [(x.request_id, x.finish_reason) for x in deltas] == [(target, "abort")]
    assert request.state is RequestState.FINISHED and target not in d.scheduler.requests
    d.run()
    d.scheduler.schedule()
    assert d.pool.num_free_blocks == 6


def _multi_turn(d: Driver, turns=3, conversations=3, output_len=6):
    """Each turn re-sends the conversation so far plus a new user message."""
    history = {c: [5 + c] * 9 for c in range(conversations)}
    for turn in range(turns):
        for c, tokens in history.items():
            d.scheduler.add_request(AddRequest(f"c{c}t{turn}", list(tokens), SamplingParams(
                max_tokens=output_len, temperature=0, ignore_eos=True), 0, 0.0))
        d.run()
        for c in history:
            history[c] += d.outputs[f"c{c}t{turn}"][0] + [40 + turn] * 3
    return d


@pytest.mark.parametrize("num_blocks", [64, 12])
def test_prefix_caching_computes_less_and_changes_no_token(num_blocks):
    on = _multi_turn(Driver(num_blocks=num_blocks, max_model_len=128))
    off = _multi_turn(Driver(num_blocks=num_blocks, max_model_len=128, caching=False))
    assert on.outputs == off.outputs
    computed_on = on.scheduler.num_prefill_tokens
    assert computed_on < off.scheduler.num_prefill_tokens
    if num_blocks == 64:
        # each turn finds the previous turn's computed full blocks: its prompt and all but
        # the last output token (9 + 5 = 14 tokens -> 3 blocks; 18 + 5 = 23 -> 5 blocks)
        cached = {r.request_id: r.num_cached_tokens for p in on.plans for r in p.requests}
        assert (cached["c0t0"], cached["c0t1"], cached["c0t2"]) == (0, 12, 20)
        assert on.scheduler.num_preemptions == 0
    else:
        assert on.scheduler.num_preemptions > 0  # recompute after preemption hits the cache too
    on.scheduler.schedule()
    assert on.pool.num_requests_holding_blocks == 0 and on.pool.num_free_blocks == num_blocks


def test_n_children_find_their_leaders_prompt_in_the_cache():
    d = Driver(num_blocks=64, block_size=4, max_model_len=64)
    d.scheduler.add_request(AddRequest("r", list(range(10, 23)), SamplingParams(
        n=3, max_tokens=4, temperature=0, ignore_eos=True), 0, 0.0))
    d.run()
    cached = {r.request_id: r.num_cached_tokens for p in d.plans for r in p.requests}
    assert cached == {"0_r": 0, "1_r": 12, "2_r": 12}
    assert len({tuple(d.outputs[f"{i}_r"][0]) for i in range(3)}) == 1  # greedy: one answer
