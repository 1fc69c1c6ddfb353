"""The harness drives the real ModelRunner too: same control, real tokens."""

from actorlm.fsm import RequestEvent


def run(make_harness, model_dir, num_kv_blocks):
    h = make_harness(model=str(model_dir), dtype="float32", block_size=4,
                     num_kv_blocks=num_kv_blocks, max_model_len=48, max_num_batched_tokens=16)
    ids = [h.add_request([5 + (i * 13 + j * 7) % 300 for j in range(6 + 3 * i)], max_tokens=10,
                         ignore_eos=True) for i in range(4)]
    records = h.run_until_idle()
    h.check_invariants()
    return h, ids, records


def test_a_real_model_under_kv_pressure_gives_the_unpressured_tokens(make_harness,
                                                                      tiny_llama_dir):
    roomy, ids, _ = run(make_harness, tiny_llama_dir, 64)
    tight, _, records = run(make_harness, tiny_llama_dir, 12)
    assert any(event is RequestEvent.PREEMPT for _, _, event, _ in tight.transitions)
    assert all(r.num_tokens <= 16 for r in records)
    for rid in ids:
        assert tight.requests[rid].output_token_ids == roomy.requests[rid].output_token_ids
        assert len(roomy.requests[rid].output_token_ids) == 10
        assert tight.output(rid).outputs[0].text  # decoded by the model's own tokenizer
