"""Expert parallelism (``--enable-expert-parallel``): 2 CPU ranks (gloo) each hold 4 of the 8
experts whole, and compute what one rank computes.

The families' tiny checkpoints (``checkpoints.tiny_moe_dirs``: Qwen3-MoE, from per-expert and
from stacked tensors; Qwen2-MoE, whose shared expert stays split; Mixtral; GLM-4.5; GPT-OSS,
whose experts' biases go with them) run on 2 ranks in
one launch (``tp_helpers.run_ranks``), driven as the executor drives them
(``tp_steps.greedy_steps``); rank 0's tokens must be the unsplit runner's and transformers',
its logits the unsplit runner's to fp32 rounding, and a prompt's logits transformers'. Each
rank must hold whole experts, its own half of them, in what the backend prepared. The
engine, its workers in processes of their own (``distributed_executor_backend="mp"``), gives
one rank's greedy tokens. Under the model: the backends' ``fused_moe`` over a rank's experts
(the torch path of both wings, the CPU's C++ experts, the one-call decode step), and the splits
refused before anything loads.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from paged_contexts import PagedContexts
from test_decode_layers import needs_kernels
from tp_helpers import run_ranks
from tp_steps import ATOL, PROMPTS, greedy_steps, hf_greedy

from actorlm import SamplingParams
from actorlm.config import EngineConfig
from actorlm.kernels import Experts, select_backend
from actorlm.llm import LLM
from actorlm.models.expert_parallel import split_intermediate_sizes
from actorlm.models.loader import load_hf_config, load_model
from actorlm.models.parallel import TensorParallel, check_tensor_parallel
from actorlm.models.parts import load_model_parts

EP = 2
FAMILIES = ["qwen3_moe", "qwen3_moe_stacked", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss"]
NUM_EXPERTS, EXPERT_FEATURES, NUM_ROUTED_LAYERS = 8, 32, 2  # each tiny checkpoint's


def expert_parallel_rank(tp: TensorParallel, paths: dict) -> dict:
    """On each rank: ``greedy_steps`` with the experts placed whole, and a prompt's logits
    from a model loaded straight from the checkpoint (rank 0; None on the others)."""
    tp = dataclasses.replace(tp, expert_parallel=True)
    results = {}
    for name, path in paths.items():
        model = load_model(path, torch.float32, "cpu", select_backend("cpu"), tp)
        logits = PagedContexts(model).step(model, [(0, PROMPTS[0])])
        results[name] = {**greedy_steps(tp, path),
                         "prompt_logits": None if logits is None else logits.numpy()}
    return results


@pytest.fixture(scope="module")
def split(tiny_moe_dirs):
    """Every family on 2 expert-parallel ranks, in one launch: [rank 0's results, rank 1's]."""
    return run_ranks(expert_parallel_rank, EP, {name: tiny_moe_dirs[name] for name in FAMILIES})


@pytest.mark.parametrize("name", FAMILIES)
def test_two_expert_parallel_ranks_compute_what_one_computes(name, tiny_moe_dirs, split):
    path = tiny_moe_dirs[name]
    whole = greedy_steps(TensorParallel(), path)
    ours = split[0][name]
    assert ours["tokens"] == whole["tokens"]
    assert ours["tokens"] == [hf_greedy(path, p, len(t)) for p, t in zip(PROMPTS, ours["tokens"])]
    assert len(ours["logits"]) == len(whole["logits"])
    for got, expected in zip(ours["logits"], whole["logits"]):
        torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(expected),
                                   atol=ATOL, rtol=0)
    assert split[1][name]["prompt_logits"] is None  # rank 0 gathers the logits
    torch.testing.assert_close(torch.from_numpy(ours["prompt_logits"]),
                               _hf_logits(path, PROMPTS[0]), atol=2e-4, rtol=0)


def _hf_logits(path, prompt) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("name", FAMILIES)
def test_each_rank_holds_its_half_of_the_experts_whole(name, split):
    # (the router's id of the first expert, experts held, features of each), as prepared
    share = NUM_EXPERTS // EP
    assert [rank_results[name]["experts"] for rank_results in split] == \
        [[(rank * share, share, EXPERT_FEATURES)] * NUM_ROUTED_LAYERS for rank in range(EP)]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_worker_processes_give_one_ranks_greedy_tokens(family, tiny_moe_dirs):
    """The flag through the engine: its workers in processes, each loading its experts."""
    path = str(tiny_moe_dirs[family])
    config = EngineConfig(model=path, tensor_parallel_size=EP, enable_expert_parallel=True)
    assert load_model_parts(config).parts.make_runner.enable_expert_parallel  # the workers'
    prompts = ["Once upon a time", "1, 2, 3,"]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    flags = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 128, "max_model_len": 128}
    runs = []
    for parallel in ({}, {"tensor_parallel_size": EP, "enable_expert_parallel": True,
                          "distributed_executor_backend": "mp"}):
        with LLM(path, **flags, **parallel) as llm:
            runs.append([out.outputs[0].token_ids
                         for out in llm.generate(prompts, greedy, use_tqdm=False)])
    assert runs[1] == runs[0]
    assert all(len(tokens) == 12 for tokens in runs[0])


# --- a rank's experts in the backends -----------------------------------------------------------


def _moe_inputs(num_tokens, num_experts, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden, features = 48, 24
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * features, hidden, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(num_experts, hidden, features, generator=gen) * 0.2).to(dtype)
    # values 0.4 apart: no two experts tie, so every rank routes alike
    order = torch.argsort(torch.rand(num_tokens, num_experts, generator=gen), dim=-1)
    return x, (order.float() * 0.4).to(dtype), gate_up, down


def _rank_experts(gate_up, down, rank, num_ranks) -> Experts:
    share = gate_up.shape[0] // num_ranks
    held = slice(rank * share, (rank + 1) * share)
    return Experts(gate_up[held].contiguous(), down[held].contiguous(), "silu", rank * share)


@pytest.mark.parametrize("wing", ["cpu", "triton"])
@pytest.mark.parametrize("prepared", [False, True], ids=["stacked", "prepared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens, num_experts, top_k, num_ranks", [
    (1, 8, 2, 2),  # a decode: its two experts on one rank or on both
    (37, 8, 2, 4),
    (9, 6, 3, 2),
])
def test_the_ranks_experts_sum_to_all_experts(wing, prepared, dtype, num_tokens, num_experts,
                                              top_k, num_ranks, monkeypatch):
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", wing)
    backend = select_backend("cpu")
    x, logits, gate_up, down = _moe_inputs(num_tokens, num_experts, dtype)

    def run(experts):
        return backend.fused_moe(x, logits, backend.prepare_experts(experts) if prepared
                                 else experts, top_k, True)

    whole = run(Experts(gate_up, down))
    parts = [run(_rank_experts(gate_up, down, rank, num_ranks)) for rank in range(num_ranks)]
    total = parts[0]
    for part in parts[1:]:
        total = total + part  # as the all-reduce sums them, in the dtype
    if top_k <= 2:  # a token's two slots: on one rank, in its order; or one on each, a + b
        assert torch.equal(total, whole)
    else:  # the sums in another order
        torch.testing.assert_close(total, whole, atol=1e-5 if dtype == torch.float32 else 2e-2,
                                   rtol=0)


@pytest.mark.parametrize("prepared", [False, True], ids=["stacked", "prepared"])
def test_a_rank_whose_experts_no_token_picks_adds_nothing(prepared):
    backend = select_backend("cpu")
    x, logits, gate_up, down = _moe_inputs(5, 8, torch.float32)
    logits[:, 4:] -= 100  # every token to experts 0..3: rank 0's
    experts = _rank_experts(gate_up, down, 1, 2)
    out = backend.fused_moe(x, logits, backend.prepare_experts(experts) if prepared else experts,
                            2, False)
    assert torch.equal(out, torch.zeros_like(x))


@needs_kernels
def test_the_one_call_decode_step_runs_a_ranks_experts(tiny_moe_dirs):
    """The C++ decode step over a plan whose last layer holds half the experts (as each
    expert-parallel rank's would): the two halves' outputs sum to the whole's."""
    path, backend = tiny_moe_dirs["qwen3_moe"], select_backend("cpu")
    model = load_model(path, torch.float32, "cpu", backend)
    *first, last = [layer.plan() for layer in model.model.layers]
    halves = []
    for rank in range(EP):  # a rank's experts, loaded as the rank loads them
        shard = load_model(path, torch.float32, "cpu", backend,
                           TensorParallel(rank, EP, expert_parallel=True))
        experts = shard.model.layers[-1].mlp.experts.stacked
        assert (experts.first_expert, experts.num_experts) == (rank * 4, 4)
        halves.append(backend.decode_step(
            [*first, last._replace(moe=last.moe._replace(experts=experts))], torch.float32))
    whole, outputs = model.decode_step, []

    def every_step(x, ropes, kv_caches, metas, lora_slots):
        # (the halves first: each step writes into x; the K/V each writes are the whole's)
        parts = [half(x.clone(), ropes, kv_caches, metas, lora_slots) for half in halves]
        out = whole(x, ropes, kv_caches, metas, lora_slots)
        if out is not None:  # (a prefill: None from each, the Python layers run)
            outputs.append((out[0].clone(), [part[0] for part in parts]))
        return out

    model.decode_step = every_step
    cache = PagedContexts(model)
    cache.step(model, [(0, PROMPTS[0]), (1, PROMPTS[1])])
    for token in (11, 12, 13):
        cache.step(model, [(0, [token]), (1, [token + 1])])
    assert len(outputs) == 3 and all(half.num_steps == 3 for half in halves)
    for out, parts in outputs:
        assert torch.equal(parts[0] + parts[1], out)  # top 2: as fused_moe sums them


# --- refused before loading ---------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_experts_that_do_not_divide_among_the_ranks_are_refused_before_loading(
        family, tiny_moe_dirs, tmp_path):
    # only the config: the refusal comes before any weight (or tokenizer) is read; (both
    # families' configs write num_experts as num_local_experts)
    config = json.loads((tiny_moe_dirs[family] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_local_experts": 6}))
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 does not divide .*'s 6 "
                                         r"experts under --enable-expert-parallel"):
        load_model_parts(EngineConfig(model=str(tmp_path), tensor_parallel_size=4,
                                      enable_expert_parallel=True))


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_expert_parallel_on_a_dense_model_is_refused(tensor_parallel_size, tiny_llama_dir,
                                                     tmp_path):
    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="--enable-expert-parallel applies only to mixtures "
                                         "of experts; .* has no routed experts"):
        load_model_parts(EngineConfig(model=str(tmp_path), enable_expert_parallel=True,
                                      tensor_parallel_size=tensor_parallel_size))


def test_whole_experts_need_not_split_their_features(tiny_moe_dirs, tmp_path):
    # experts of 30 features do not split 4 ways, but under expert parallelism none is split
    config = load_hf_config(tiny_moe_dirs["qwen3_moe"])
    config.moe_intermediate_size = 30
    with pytest.raises(ValueError, match="experts' intermediate size 30"):
        check_tensor_parallel("m", 4, 2, split_intermediate_sizes(config, False), 4)
    check_tensor_parallel("m", 4, 2, split_intermediate_sizes(config, True), 4)
