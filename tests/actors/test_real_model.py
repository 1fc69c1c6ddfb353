"""The harness drives the real ModelRunner too: same control, real tokens. And the runner
with its KV cache in groups, under the real scheduler and block pool."""

import torch

from actorlm.core.scheduler import SchedulerConfig
from actorlm.fsm import RequestEvent
from actorlm.kernels import select_backend
from actorlm.kv_groups import KVCacheGroup
from actorlm.messages import AddRequest
from actorlm.models.loader import load_model
from actorlm.models.runner import ModelRunner
from actorlm.sampling_params import SamplingParams
from actorlm.trace.replay import SyncEngine


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


def _greedy_tokens(runner, windows, prompts, num_kv_blocks):
    """Each prompt's greedy tokens through the real scheduler and block pool (serving
    ``windows``' groups) and ``runner``, in one thread."""
    engine = SyncEngine(SchedulerConfig(16, 4, 48, 4), num_kv_blocks, runner=runner,
                        kv_cache_windows=windows)
    for i, prompt in enumerate(prompts):
        engine.send(AddRequest(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10,
                                                               ignore_eos=True), 0, 0.0))
    engine.run_until_idle()
    tokens = {}
    for outputs in engine.outputs:
        for delta in outputs.deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert engine.pool.num_free_blocks == engine.pool.num_total_blocks  # nothing leaked
    return tokens, engine


def test_a_real_model_in_two_kv_cache_groups_gives_one_groups_tokens(tiny_llama_dir):
    backend = select_backend("cpu")
    shared = [5 + (j * 7) % 300 for j in range(13)]
    prompts = [shared + [40 + i] * (2 + i) for i in range(3)] + [[9, 8, 7, 6, 5]]
    model = load_model(tiny_llama_dir, torch.float32, "cpu", backend)
    one, _ = _greedy_tokens(ModelRunner(model, backend, 48, 4, torch.float32,
                                        torch.device("cpu")), [None], prompts, 48)
    # the same layers as two full-attention groups of one layer each: one pair of KV
    # tensors, which each block id is a page of in the group that holds it
    model.kv_cache_groups = [KVCacheGroup(None, (0,)), KVCacheGroup(None, (1,))]
    for i, layer in enumerate(model.model.layers):
        layer.kv_group = i
    model.decode_step = None  # the Python layers, each reading its group's metadata
    runner = ModelRunner(model, backend, 28, 4, torch.float32, torch.device("cpu"))
    assert len(runner.kv_pairs) == 1 and runner.kv_caches[0] is runner.kv_caches[1]
    two, engine = _greedy_tokens(runner, [None, None], prompts, 28)
    assert two == one and all(len(t) == 10 for t in two.values())
    assert engine.pool.prefix_cache_hits > 0  # the shared prefix hit in both groups
    assert engine.scheduler.num_preemptions > 0  # 28 blocks for two groups are tight
