"""Driving a model's runner on every rank as the scheduler and executor would
(``greedy_steps``), for the tests of tensor and expert parallelism: a prefill of 3 prompts
(one chunked over two steps, one asking for prompt logprobs), then greedy decodes, one of them
under a grammar bitmask; and transformers' greedy tokens to hold them to (``hf_greedy``)."""

from __future__ import annotations

import torch
from tp_helpers import share

from actorlm.kernels import Experts
from actorlm.kv_groups import kv_cache_groups
from actorlm.messages import CachedRequestData, GrammarBitmask, NewRequestData, ScheduleStep
from actorlm.models.families import layer_windows
from actorlm.models.loader import load_hf_config
from actorlm.models.moe import SparseMoeBlock
from actorlm.models.parallel import TensorParallel
from actorlm.models.parts import RunnerFactory
from actorlm.sampling_params import SamplingParams

PROMPTS = [[17, 250, 3, 99, 41, 120, 7, 300, 64, 11, 205], [5, 88, 160, 23], [42, 9, 310, 77, 150]]
CHUNK = 5  # the first prompt prefills in two steps
NUM_STEPS = 8  # step 0 prefills; the first prompt finishes its prefill in step 1
CONSTRAINED_STEP = 3  # the second request samples under an (all-allowing) grammar bitmask
BLOCK_SIZE, BLOCKS_PER_REQUEST = 4, 8
ATOL = 1e-4


def assert_alike_but_for_int8_steps(ours: list, whole: list, what) -> None:
    """Rank 0's logits within fp32 rounding of one rank's but for the odd row, for weights in
    blocks: two ranks sum their shares in another order (fp32 rounding), and the kernels read
    the activations as int8 per block, as ggml does, so now and then such a rounding carries
    one value across an int8 step and that token's logits move by a few hundredths (seen on a
    Zen 3 and a Zen 4, never on a Xeon). A split that cut the blocks wrongly would move every
    row, by far more."""
    import numpy as np

    rows = np.concatenate([np.abs(got - expected).max(-1)
                           for got, expected in zip(ours, whole, strict=True)])
    assert (rows <= ATOL).mean() >= 0.9 and rows.max() < 0.1, (what, rows)


def greedy_steps(tp: TensorParallel, path) -> dict | None:
    """Drive rank ``tp.rank``'s runner (its experts placed whole with ``tp.expert_parallel``)
    as the scheduler and executor would; every rank returns its KV cache's shape and its
    experts' placement, rank 0 also the sampled tokens, every logits tensor the model
    computed and the prompt logprobs."""
    num_groups = len(kv_cache_groups(layer_windows(load_hf_config(path))))
    factory = RunnerFactory(path, torch.float32, torch.device("cpu"), BLOCK_SIZE, frozenset(),
                            num_kv_blocks=num_groups * len(PROMPTS) * BLOCKS_PER_REQUEST,
                            tensor_parallel_size=tp.size,
                            enable_expert_parallel=tp.expert_parallel)
    runner = factory(tp.rank)
    logits_seen = []
    if tp.is_driver:
        compute = runner.model.compute_logits

        def recording(hidden):
            logits = compute(hidden)
            logits_seen.append(logits.numpy().copy())
            return logits

        runner.model.compute_logits = recording
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    tokens, computed = [list(p) for p in PROMPTS], [0] * len(PROMPTS)
    prompt_logprobs = []
    for step_id in range(NUM_STEPS):
        step = None
        if tp.is_driver:  # the scheduler's message, the same on every rank (``share``)
            step = _step(step_id, ids, tokens, computed, num_groups)
        step = share(tp, step)
        result = runner.execute(step)
        if step.structured_request_ids and tp.is_driver:
            assert result is None  # rank 0 waits for the bitmask
            words = -(-runner.model.vocab_size // 32)
            allowed = torch.full((len(step.structured_request_ids), words), -1, dtype=torch.int32)
            result = runner.sample_tokens(GrammarBitmask(step_id, step.structured_request_ids,
                                                         allowed.numpy().tobytes()))
        if not tp.is_driver:  # answers at once, with nothing: rank 0 answers for the step
            assert result.request_ids == [] and result.sampled_token_ids == []
            assert result.step_id == step_id and len(result.timings) == 3
            continue
        computed = [c + n for c, n in zip(computed, step.num_scheduled_tokens)]
        for rid, token in zip(result.request_ids, result.sampled_token_ids):
            tokens[ids.index(rid)].append(token)
        prompt_logprobs += [(p.request_id, p.start, [(x.token_ids, x.logprobs) for x in p.positions])
                            for p in result.prompt_logprobs]
    held = {"kv_shape": tuple(runner.kv_caches[0][0].shape),
            "experts": experts_placement(runner.model)}
    if not tp.is_driver:
        return held
    return {"tokens": [t[len(p):] for t, p in zip(tokens, PROMPTS)], "logits": logits_seen,
            "prompt_logprobs": prompt_logprobs, **held}


def experts_placement(model) -> list[tuple[int, int, int]]:
    """(the router's id of the first, how many, each one's intermediate features) of the
    experts each routed layer holds, read from what the backend prepared: the weights the
    step runs, not the layer's own account of them."""
    placement = []
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            prepared = layer.mlp.experts.prepared
            if isinstance(prepared, Experts):  # as they came
                count, features = prepared.gate_up.shape[0], prepared.down.shape[2]
            else:  # the CPU's panels
                count, features = prepared.num_experts, prepared.intermediate
            placement.append((prepared.first_expert, count, features))
    return placement


def _step(step_id, ids, tokens, computed, num_groups) -> ScheduleStep:
    if step_id == 0:  # each request its own blocks in each KV-cache group
        first = [[(g * len(PROMPTS) + i) * BLOCKS_PER_REQUEST for g in range(num_groups)]
                 for i in range(len(PROMPTS))]
        new = [NewRequestData(rid, list(p), len(p),
                              [list(range(b, b + BLOCKS_PER_REQUEST)) for b in first[i]], 0,
                              SamplingParams(temperature=0.0, prompt_logprobs=3 if i == 2 else None),
                              seed=0)
               for i, (rid, p) in enumerate(zip(ids, PROMPTS))]
        return ScheduleStep(0, new, [], [CHUNK] + [len(p) for p in PROMPTS[1:]], [])
    cached = [CachedRequestData(rid, [], c) for rid, c in zip(ids, computed)]
    counts = [len(t) - c for t, c in zip(tokens, computed)]
    constrained = [ids[1]] if step_id == CONSTRAINED_STEP else []
    return ScheduleStep(step_id, [], cached, counts, [], constrained, [t[-1] for t in tokens])


def hf_greedy(path, prompt, num_tokens) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
