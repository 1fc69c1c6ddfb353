"""The scheduler with speculative drafts, driven by hand: drafts count against the budget, a
verification's rejected drafts are rolled back (never computed, never cached), a length cap or
a stop inside the accepted drafts cuts the output there, and the tokens are those of a run
without drafts."""

import random

from test_scheduler import Driver, fake_token

from actorlm.core.block_hash import extend_block_hashes
from actorlm.messages import StepResult


class DraftDriver(Driver):
    """Driver whose 'runner' verifies drafts against ``fake_token`` and proposes the true
    continuation with one draft in three spoiled (a random place, from a fixed seed)."""

    def __init__(self, k=3, **kw):
        super().__init__(**kw)
        self.scheduler.config = type(self.scheduler.config)(**{
            **self.scheduler.config.__dict__, "speculative": True})
        self.k, self.rng, self.computed_blocks = k, random.Random(0), []

    def _propose(self, token_ids):
        drafts, tokens = [], list(token_ids)
        for _ in range(self.k):
            drafts.append(fake_token(tokens))
            tokens.append(drafts[-1])
        if self.rng.random() < 0.67:
            drafts[self.rng.randrange(self.k)] = 1  # a token fake_token never gives
        return drafts

    def result_of(self, plan) -> StepResult:
        assert plan.num_tokens <= self.scheduler.config.max_num_batched_tokens
        self.computed_blocks += plan.computed_blocks
        sampled = [r for r in plan.requests if r.num_computed_tokens == r.num_tokens_with_spec]
        ids, tokens, accepted, proposed = [], [], [], []
        for r in sampled:
            context, kept = r.all_token_ids, []
            for draft in r.spec_token_ids:
                if draft != fake_token(context + kept):
                    break
                kept.append(draft)
            ids.append(r.request_id)
            tokens.append(fake_token(context + kept))
            accepted.append(kept)
            proposed.append(self._propose(context + kept + tokens[-1:]))
        return StepResult(plan.step_id, ids, tokens, accepted_token_ids=accepted,
                          spec_token_ids=proposed)


def _workload(driver):
    for i, (prompt_len, max_tokens) in enumerate([(5, 9), (17, 20), (3, 1), (30, 14), (8, 33)]):
        driver.add(f"r{i}", prompt_len, max_tokens=max_tokens)
    return driver.run()


def test_drafts_change_the_steps_not_the_tokens():
    plain = _workload(Driver(budget=12, max_seqs=4))
    for k in (1, 3, 5):
        drafted = _workload(DraftDriver(k, budget=12, max_seqs=4))
        assert drafted.outputs == plain.outputs  # max_tokens cut the drafts exactly
        assert len(drafted.plans) < len(plain.plans)
        counts = drafted.scheduler.spec_decoding
        assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
        assert drafted.pool.num_free_blocks == 64  # nothing leaked
        assert drafted.pool.num_requests_holding_blocks == 0


def test_only_verified_tokens_reach_the_prefix_cache():
    driver = _workload(DraftDriver(3, budget=12, max_seqs=4))
    block_size = driver.scheduler.config.block_size
    prompts = {}
    for i, prompt_len in enumerate([5, 17, 3, 30, 8]):
        rng = random.Random(f"r{i}")
        prompts[f"r{i}"] = [rng.randrange(5, 95) for _ in range(prompt_len)]
    assert driver.computed_blocks
    for blocks in driver.computed_blocks:
        tokens = prompts[blocks.request_id] + driver.outputs[blocks.request_id][0]
        hashes = []
        extend_block_hashes(hashes, tokens, block_size)
        first = blocks.first_block
        assert blocks.block_hashes == hashes[first:first + len(blocks.block_hashes)]
