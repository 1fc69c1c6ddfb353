"""Property: whatever arrives, whatever is aborted or fails, however small the KV pool and
whatever its KV-cache groups (full attention, sliding windows, both), the real actors end idle
with every request finished exactly once, every block back, every step within its budgets,
only legal state transitions, and greedy tokens that do not depend on batching, chunking or
preemption."""

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from actorlm.fsm import REQUEST_LIFECYCLE, Machine, RequestEvent
from actorlm.testing import EngineHarness, ManualClock


@dataclass(frozen=True)
class Engine:
    block_size: int
    max_model_len: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    chunked: bool
    vocab_size: int
    eos: tuple[int, ...]
    windows: tuple[int | None, ...]  # the KV-cache groups' (None: full attention)


@st.composite
def engines(draw):
    # sampled_from draws uniformly, where st.integers favours small values: this keeps pools
    # tight and prompts long enough that preemption and chunking are common
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.sampled_from([6, 12, 20, 32, 40]))
    window = draw(st.sampled_from([1, 3, 5, 8, 13]))
    windows = draw(st.sampled_from([(None,), (None,), (None, window), (window,),
                                    (window, None, 2 * window)]))
    per_sequence = -(-max_model_len // block_size)
    # one sequence fits in every group (and block 0 is the placeholder with a sliding one)
    num_kv_blocks = len(windows) * per_sequence + (windows != (None,)) + \
        draw(st.sampled_from(range(per_sequence // 2 + 1)))
    chunked = draw(st.booleans())
    budgets = [1, 3, 8, 16, 32, 64] if chunked else [max_model_len, max_model_len + 7, 64]
    budget = draw(st.sampled_from([b for b in budgets if chunked or b >= max_model_len]))
    vocab_size = draw(st.sampled_from([16, 1000]))  # 16: EOS and stop tokens are frequent
    eos = tuple(draw(st.sets(st.integers(10, vocab_size - 1), max_size=1)))
    return Engine(block_size, max_model_len, num_kv_blocks, budget,
                  draw(st.sampled_from(range(1, 9))), chunked, vocab_size, eos, windows)


def events(engine: Engine):
    def prompt(length):
        return st.lists(st.integers(0, engine.vocab_size - 1), min_size=length, max_size=length)

    add = st.tuples(st.just("add"),
                    st.sampled_from(range(1, engine.max_model_len + 1)).flatmap(prompt),
                    st.sampled_from(range(1, 2 * engine.max_model_len + 1)), st.booleans(),
                    st.lists(st.integers(10, engine.vocab_size - 1), max_size=1))
    later = st.one_of(add, add, add, st.tuples(st.just("step"), st.integers(1, 4)),
                      st.tuples(st.just("abort"), st.integers(0, 30)),
                      st.tuples(st.just("fail"), st.integers(0, 30)))
    return st.tuples(add, add, st.lists(later, max_size=20)).map(lambda t: [t[0], t[1], *t[2]])


def natural_outcome(runner, engine, prompt, max_tokens, ignore_eos, stop_token_ids):
    """The tokens and finish reasons of an undisturbed run (both, when length and a stop
    token land on the same token)."""
    out = []
    while True:
        token = runner.token_at(prompt, len(prompt) + len(out))
        out.append(token)
        reasons = set()
        if len(prompt) + len(out) >= engine.max_model_len or len(out) >= max_tokens:
            reasons.add("length")
        if (not ignore_eos and token in engine.eos) or token in stop_token_ids:
            reasons.add("stop")
        if reasons:
            return out, reasons


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traffic_through_the_real_actors(data):
    engine = data.draw(engines(), label="engine")
    script = data.draw(events(engine), label="events")
    with EngineHarness(clock=ManualClock(), block_size=engine.block_size,
                       max_model_len=engine.max_model_len, num_kv_blocks=engine.num_kv_blocks,
                       max_num_batched_tokens=engine.max_num_batched_tokens,
                       max_num_seqs=engine.max_num_seqs,
                       enable_chunked_prefill=engine.chunked, vocab_size=engine.vocab_size,
                       eos_token_ids=engine.eos, kv_cache_windows=engine.windows) as h:
        submitted, aborted, faulted = {}, set(), set()
        for action in script:
            kind = action[0]
            if kind == "add":
                _, prompt, max_tokens, ignore_eos, stop_ids = action
                rid = h.add_request(prompt, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                    stop_token_ids=stop_ids)
                submitted[rid] = (prompt, max_tokens, ignore_eos, stop_ids)
            elif kind == "step":
                for _ in range(action[1]):
                    h.step()
            elif submitted:
                rid = list(submitted)[action[1] % len(submitted)]
                if kind == "abort":
                    h.abort(rid)
                    aborted.add(rid)
                else:
                    h.runner.fail_request(rid)
                    faulted.add(rid)
        h.run_until_idle()
        h.check_invariants()  # budgets, finish-once, no block leaked, fake-runner checks
        for record in h.steps:  # a plan that preempts admits no one
            assert not (record.preempted_ids and any(
                event is RequestEvent.SCHEDULE for _, _, event, _ in record.transitions))
        event(f"preempted: {any(r.num_preemptions for r in h.requests.values())}")
        chunked = any(n < len(d.token_ids) for step in h.scheduled_steps
                      for d, n in zip(step.new_requests, step.num_scheduled_tokens))
        event(f"chunked: {chunked}")
        event(f"KV-cache groups: {engine.windows}")
        for reason in {r.finish_reason for r in h.requests.values()}:
            event(f"finished with {reason}")

        for rid, (prompt, max_tokens, ignore_eos, stop_ids) in submitted.items():
            record = h.requests[rid]
            assert record.is_finished and record.num_finish_deltas == 1
            finals = [o for o in h.request_outputs[rid] if o.finished]
            assert len(finals) == 1 and finals[0].outputs[0].token_ids == record.output_token_ids
            machine = Machine(REQUEST_LIFECYCLE, rid)  # replay: only legal moves, one finish
            for source, request_event, _ in record.transitions:
                assert machine.state is source
                machine.fire(request_event)
            assert machine.is_terminal
            tokens, reasons = natural_outcome(h.runner, engine, prompt, max_tokens, ignore_eos,
                                              stop_ids)
            if record.finish_reason in ("abort", "error"):
                assert rid in (aborted if record.finish_reason == "abort" else faulted)
                assert record.output_token_ids == tokens[:len(record.output_token_ids)]
                assert len(record.output_token_ids) < len(tokens)
            else:
                assert record.output_token_ids == tokens
                assert record.finish_reason in reasons
