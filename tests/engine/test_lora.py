"""LoRA adapters served from one base model, batched together: each request of a mixed batch
(three adapters and the base model) gets PEFT's greedy tokens and logprobs for its adapter;
the prefix cache never serves one adapter's KV to another; ``max_loras`` caps the adapters of a
step without starving the ones that wait; preemption keeps the tokens; what cannot run is
refused naming it, and the engine keeps serving."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import TOP, assert_idle_and_nothing_leaked, engine_greedy
from greedy import check_logprobs_close

from actorlm import LoRARequest, SamplingParams
from actorlm.models.lora_slots import LoRASlots

NUM_TOKENS = 12
PROMPTS = [[5, 17, 33, 8, 91, 4, 60], [12, 7, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]
LORA_FLAGS = dict(enable_lora=True, max_loras=4, max_lora_rank=16, dtype="float32")


def requests_of(adapters):
    """name -> its LoRARequest (ids 1, 2, 3 in name order); "base": None."""
    loras = {name: LoRARequest(name, i, str(path))
             for i, (name, path) in enumerate(sorted(adapters.items()), 1)}
    return {"base": None, **loras}


def peft_greedy(model_dir, adapter_dir, prompts, base=None):
    """PEFT's (or, without an adapter, transformers') greedy tokens, top-5 ids at each
    position and the logprob of each token chosen; on ``base`` (a transformers model) where
    given, else on the checkpoint ``model_dir``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = base if base is not None else \
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids, tokens, tops, logprobs = list(prompt), [], [], []
            for _ in range(NUM_TOKENS):  # (no KV cache: a plain oracle)
                last = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                token = int(last.argmax())
                tokens.append(token)
                tops.append(set(last.topk(TOP).indices.tolist()))
                logprobs.append(float(last[token]))
                ids.append(token)
            results.append((tokens, tops, logprobs))
    return results


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir, tiny_llama_adapters):
    """name -> PEFT's greedy results on PROMPTS."""
    return {name: peft_greedy(tiny_llama_dir, None if lora is None else lora.lora_path, PROMPTS)
            for name, lora in requests_of(tiny_llama_adapters).items()}


def mixed_run(llm, adapters, names):
    """Every prompt under each adapter of ``names`` in one batch -> name -> outputs."""
    loras = requests_of(adapters)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=TOP)
    batch = [(name, p) for name in names for p in PROMPTS]
    outputs = llm.generate([{"prompt_token_ids": p} for _, p in batch], params, use_tqdm=False,
                           lora_request=[loras[name] for name, _ in batch])
    by_name = {}
    for (name, _), output in zip(batch, outputs):
        by_name.setdefault(name, []).append(output)
    return by_name


def assert_like_peft(by_name, oracle):
    for name, outputs in by_name.items():
        expected = oracle[name] * (len(outputs) // len(PROMPTS))  # (a name listed twice)
        check_logprobs_close(engine_greedy(outputs), [(t, tops) for t, tops, _ in expected])
        for output, (tokens, _, logprobs) in zip(outputs, expected):
            ours = output.outputs[0]
            for position, token in enumerate(tokens):
                if ours.token_ids[position] != token:
                    break  # diverged at a near-tie (check_logprobs_close allowed it)
                got = ours.logprobs[position][token].logprob
                assert abs(got - logprobs[position]) < 2e-3, (name, position, got)


def test_a_mixed_batch_gives_each_request_its_adapters_output(make_llm, tiny_llama_dir,
                                                              tiny_llama_adapters, oracle):
    llm = make_llm(str(tiny_llama_dir), **LORA_FLAGS)
    names = ["base", "alpha", "beta", "gamma"]
    by_name = mixed_run(llm, tiny_llama_adapters, names)
    assert_like_peft(by_name, oracle)
    # the adapters change the output (else the test could not tell them apart)
    tokens = {name: [o.outputs[0].token_ids for o in by_name[name]] for name in names}
    assert len({json.dumps(t) for t in tokens.values()}) == len(names)
    assert_idle_and_nothing_leaked(llm)


# the families' own names of their projections, where they are not Llama's
UNGATED_TARGETS = {"opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
                   "phi": ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"],
                   "starcoder2": ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"],
                   # (c_proj: the attention's output and the MLP's)
                   "gpt2": ["c_attn", "c_proj", "c_fc"],
                   # (q/k/v fused per head in query_key_value)
                   "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
                   # (q/k/v fused per head in c_attn without multi-query)
                   "gpt_bigcode_mha": ["c_attn", "c_proj", "c_fc"],
                   # (Falcon-7B's one KV head after the queries; 40B's groups of queries, key
                   # and value; the first decoder's without multi-query: each head's together)
                   **{falcon: ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
                      for falcon in ("falcon", "falcon_new", "falcon_sequential")},
                   # (an ungated MLP under a gated one's names)
                   "nemotron": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}


@pytest.mark.parametrize("family", ["qwen2", "granite", "glm4", *UNGATED_TARGETS])
def test_a_mixed_batch_of_another_family_gives_each_request_its_adapters_output(
        make_llm, tiny_qwen2_dir, tiny_window_dirs, tmp_path_factory, family):
    """Qwen2 (q, k and v with biases, an untied LM head): the deltas join the biased
    projections as PEFT's do. Granite: the deltas of o_proj and down_proj are scaled with
    their projections' outputs by the residual multiplier, as in PEFT's model. GLM-4: the
    deltas' rows of q and k reordered as the base model's are (RoPE on half of each head, in
    interleaved pairs). OPT, Phi-2, StarCoder2, GPT-2, GPT-NeoX and Nemotron: adapters of
    their ungated MLPs and of their projections under their own names (PEFT's classic OPT
    adapter: q/k/v, out_proj, fc1, fc2; GPT-2's on its Conv1D layers, q/k/v fused in c_attn;
    GPT-NeoX's query_key_value and GPT-BigCode's c_attn without multi-query, each head's q, k
    and v together; Falcon's query_key_value in its three layouts; Nemotron's up_proj
    alone)."""
    from lora_adapters import make_adapter

    model_dir = tiny_qwen2_dir if family == "qwen2" else tiny_window_dirs[family]
    targets = {"target_modules": UNGATED_TARGETS[family]} if family in UNGATED_TARGETS else {}
    adapters = {}
    for seed, (name, config) in enumerate({"alpha": dict(r=4, **targets),
                                           "beta": dict(r=8, use_rslora=True,
                                                        **targets)}.items()):
        adapters[name] = tmp_path_factory.mktemp(f"{family}_lora_{name}")
        make_adapter(model_dir, adapters[name], seed=30 + seed, **config)
    oracle = {name: peft_greedy(model_dir, None if lora is None else lora.lora_path, PROMPTS)
              for name, lora in requests_of(adapters).items()}
    llm = make_llm(str(model_dir), **LORA_FLAGS)
    by_name = mixed_run(llm, adapters, ["base", "alpha", "beta"])
    assert_like_peft(by_name, oracle)
    tokens = {name: [o.outputs[0].token_ids for o in outputs] for name, outputs in by_name.items()}
    assert len({json.dumps(t) for t in tokens.values()}) == 3
    assert_idle_and_nothing_leaked(llm)


def test_at_most_max_loras_adapters_share_a_step_and_none_starves(
        make_llm, tiny_llama_dir, tiny_llama_adapters, oracle, monkeypatch):
    per_step = []
    set_mapping = LoRASlots.set_mapping
    monkeypatch.setattr(LoRASlots, "set_mapping", lambda self, loras, n: per_step.append(
        {lora.lora_int_id for lora in loras if lora is not None}) or set_mapping(self, loras, n))
    llm = make_llm(str(tiny_llama_dir), **{**LORA_FLAGS, "max_loras": 2})
    by_name = mixed_run(llm, tiny_llama_adapters, ["alpha", "base", "beta", "gamma", "alpha"])
    assert max(map(len, per_step)) == 2  # two adapters ran together, never three
    assert {1, 2, 3} <= set().union(*per_step)  # the third one got its turn
    assert_like_peft(by_name, oracle)


def test_the_prefix_cache_keeps_adapters_apart(make_llm, tiny_llama_dir, tiny_llama_adapters):
    llm = make_llm(str(tiny_llama_dir), **LORA_FLAGS, block_size=4)
    loras = requests_of(tiny_llama_adapters)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def cached(name):
        [output] = llm.generate([prompt], params, use_tqdm=False, lora_request=loras[name])
        return output.num_cached_tokens

    assert cached("base") == 0
    assert cached("alpha") == 0  # the base model's blocks are not alpha's
    assert cached("beta") == 0
    assert cached("alpha") > 0 and cached("base") > 0  # each finds its own


def test_chat_takes_an_adapter_as_generate_does(make_llm, tiny_llama_dir, tiny_llama_adapters):
    llm = make_llm(str(tiny_llama_dir), **LORA_FLAGS)
    lora = requests_of(tiny_llama_adapters)["alpha"]
    conversation = [{"role": "user", "content": "Once upon a time"}]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    [chat] = llm.chat(conversation, params, False, lora)
    ids = {"prompt_token_ids": chat.prompt_token_ids}
    [adapted] = llm.generate([ids], params, use_tqdm=False, lora_request=lora)
    [base] = llm.generate([ids], params, use_tqdm=False)
    assert chat.outputs[0].token_ids == adapted.outputs[0].token_ids
    assert adapted.outputs[0].token_ids != base.outputs[0].token_ids  # the adapter counts


def test_preemption_recomputes_an_adapters_request_with_its_adapter(
        make_llm, tiny_llama_dir, tiny_llama_adapters, oracle):
    llm = make_llm(str(tiny_llama_dir), **LORA_FLAGS, num_kv_blocks=14, block_size=4,
                   max_model_len=32)
    by_name = mixed_run(llm, tiny_llama_adapters, ["alpha", "gamma", "base"])
    assert llm.stats()["num_preemptions"] > 0
    assert_like_peft(by_name, oracle)


def test_what_cannot_run_is_refused_and_the_engine_keeps_serving(
        make_llm, tiny_llama_dir, tiny_llama_adapters, tmp_path):
    params = SamplingParams(max_tokens=3, temperature=0.0)
    lora = requests_of(tiny_llama_adapters)["alpha"]
    plain = make_llm(str(tiny_llama_dir), dtype="float32")
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate([PROMPTS[0]], params, use_tqdm=False, lora_request=lora)
    llm = make_llm(str(tiny_llama_dir), **LORA_FLAGS)
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="r must be a positive number"):
        llm.generate([PROMPTS[0]], params, use_tqdm=False,
                     lora_request=LoRARequest("broken", 7, str(tmp_path)))
    [output] = llm.generate([PROMPTS[0]], params, use_tqdm=False, lora_request=lora)
    with pytest.raises(ValueError, match="needs an id of its own"):
        llm.generate([PROMPTS[0]], params, use_tqdm=False,
                     lora_request=LoRARequest("other", lora.lora_int_id, str(tmp_path)))
    [again] = llm.generate([PROMPTS[0]], params, use_tqdm=False, lora_request=lora)
    assert again.outputs[0].token_ids == output.outputs[0].token_ids
    assert len(output.outputs[0].token_ids) == 3
    assert_idle_and_nothing_leaked(llm)


@pytest.mark.parametrize("flags, message", [
    (dict(max_loras=2, max_cpu_loras=1), "--max-cpu-loras \\(1\\) must be at least"),
    (dict(max_lora_rank=0), "--max-lora-rank must be a positive integer"),
])
def test_settings_that_cannot_work_are_refused_at_start(flags, message):
    from actorlm.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(enable_lora=True, **flags)


@pytest.mark.slow
def test_the_triton_backend_gives_each_request_its_adapters_output(
        make_llm, tiny_llama_dir, tiny_llama_adapters, oracle, monkeypatch):
    """The Triton kernels (CPU interpreter) add the deltas of a mixed batch too."""
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", "triton")
    llm = make_llm(str(tiny_llama_dir), **LORA_FLAGS)
    assert llm.engine.backend_name == "triton"
    assert_like_peft(mixed_run(llm, tiny_llama_adapters, ["base", "alpha", "gamma"]), oracle)
