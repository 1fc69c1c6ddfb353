"""Prefix caching changes how much is computed, never the answer: a multi-turn workload (each
turn re-sends the conversation so far) with caching on, against caching off and transformers,
on the tiny models and on SmolLM2 — roomy, under preemption and with chunked prefill."""

import random

import pytest
from engine_helpers import TOP, check_logprobs_close, engine_greedy, hf_greedy

from actorlm import SamplingParams

NUM_TOKENS = 12


def _reads_prompts_in_int8() -> bool:
    """Whether this CPU's quantized linear layers read every row in int8 at fp32 (no
    dequantized-tile path for many rows)."""
    import gguf
    import numpy as np
    import torch

    from actorlm.kernels import QuantizedWeight
    from actorlm.kernels.cpu import quant

    blocks = gguf.quants.quantize(np.ones((1, 32), np.float32), gguf.GGMLQuantizationType.Q8_0)
    probe = quant.QuantLinear([QuantizedWeight("Q8_0", torch.from_numpy(blocks), (1, 32))], None)
    return probe.panel_from_rows(torch.float32) is None


def multi_turn(on, off, model_dir, first_prompts, follow_ups, num_tokens=NUM_TOKENS,
               same_bits=True, against_transformers=True):
    """Drive the turns through both engines; returns the share of prefill computed with caching
    on versus off. Each turn's prompts are the previous turn's prompts, the answers caching on
    gave and a follow-up, so both engines (and transformers) see the same prompts. Without
    ``same_bits`` (weights in blocks: a step's row count picks the kernel, int8 activations
    below a threshold, dequantized tiles above, and a prefix hit changes the rows) the two
    engines' answers need only agree by vLLM's rule."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=TOP)
    prompts, answers = first_prompts, []
    for follow_up in [None] + follow_ups:
        if follow_up is not None:
            prompts = [p + o[0] + f for p, o, f in zip(prompts, answers, follow_up)]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        answers = engine_greedy(on.generate(inputs, params, use_tqdm=False))
        without = engine_greedy(off.generate(inputs, params, use_tqdm=False))
        # the same answers with and without the cache, and transformers' answers
        if same_bits:
            assert [a[0] for a in answers] == [w[0] for w in without]
        else:
            check_logprobs_close(answers, without)
        if against_transformers:
            check_logprobs_close(answers, hf_greedy(model_dir, prompts, num_tokens))
    return on.stats()["num_prefill_tokens"] / off.stats()["num_prefill_tokens"]


def _conversations(vocab_size, num=3, first_len=20, follow_len=5, turns=3, seed=7):
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab_size) for _ in range(first_len // 2)]
    first = [system + [rng.randrange(3, vocab_size) for _ in range(first_len // 2 + i)]
             for i in range(num)]
    follow = [[[rng.randrange(3, vocab_size) for _ in range(follow_len)] for _ in range(num)]
              for _ in range(turns - 1)]
    return first, follow


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("setting", ["roomy", "preemption", "chunked"])
def test_multi_turn_with_and_without_the_cache(arch, setting, make_llm, tiny_llama_dir,
                                               tiny_qwen2_dir, tiny_qwen3_dir):
    path = str({"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "qwen3": tiny_qwen3_dir}[arch])
    flags = {"roomy": dict(block_size=4),
             # three conversations of up to ~90 tokens in 40 blocks of 4: preemption
             "preemption": dict(block_size=4, num_kv_blocks=40, max_model_len=128),
             "chunked": dict(block_size=4, max_num_batched_tokens=16)}[setting]
    on = make_llm(path, **flags)
    off = make_llm(path, enable_prefix_caching=False, **flags)
    from transformers import AutoConfig

    first, follow = _conversations(AutoConfig.from_pretrained(path).vocab_size)
    ratio = multi_turn(on, off, path, first, follow)
    assert ratio < 0.75, ratio
    stats = on.stats()
    assert stats["prefix_cache_hits"] > 0 and off.stats()["prefix_cache_queries"] == 0
    if setting == "preemption":
        assert stats["num_preemptions"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["roomy", "tight"])
def test_multi_turn_chat_on_smollm2(setting, smollm2_dir, smollm2_dense_dir, make_llm):
    # tight: 64-token prefill chunks, and 12 blocks of 16 tokens for two conversations that
    # grow past 100 tokens each, so the third turn preempts
    flags = {} if setting == "roomy" else dict(max_num_batched_tokens=64, num_kv_blocks=12,
                                                max_model_len=192)
    on = make_llm(str(smollm2_dir), **flags)
    off = make_llm(str(smollm2_dir), enable_prefix_caching=False, **flags)
    system = {"role": "system", "content": "You are a concise assistant for a bakery in Lyon."}
    questions = [["What bread do you bake?", "Which one is best with cheese?",
                  "How long does it keep?"],
                 ["Do you open on Sundays?", "And on public holidays?", "Can I order ahead?"]]
    conversations = [[system, {"role": "user", "content": q[0]}] for q in questions]
    first = [on.apply_chat_template(c) for c in conversations]
    # later turns: the answer so far is in the prompt, then the next question
    follow = [[on.tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{q[t]}<|im_end|>\n"
                                          f"<|im_start|>assistant\n", add_special_tokens=False)
               for q in questions] for t in (1, 2)]
    # transformers reads the file's weights dequantized. Where the quantized layers read every
    # row's activations in int8 (no AVX-512 dequantized tiles: the AVX2 kernels in fp32), the
    # first answer leaves vLLM's rule at its second token on a Zen 3 (transformers' token is in
    # our top 5, ours not in its): there the int8 path is judged by KL (tests/kernels,
    # tests/models/test_gguf.py) and only caching on against off is compared here
    ratio = multi_turn(on, off, smollm2_dense_dir, first, follow, num_tokens=16,
                       same_bits=False, against_transformers=not _reads_prompts_in_int8())
    assert ratio < 0.5 if setting == "roomy" else ratio < 1.0, ratio
    if setting == "tight":
        assert on.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("core_process", [False, True])
def test_a_cache_salt_shares_cached_prefixes_only_within_its_tenant(make_llm, tiny_llama_dir,
                                                                     core_process):
    llm = make_llm(str(tiny_llama_dir), block_size=4, engine_core_process=core_process)
    ids = list(range(3, 40))  # 9 full blocks
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def run(salt=None):
        prompt = {"prompt_token_ids": ids} if salt is None else \
            {"prompt_token_ids": ids, "cache_salt": salt}
        [output] = llm.generate([prompt], params, use_tqdm=False)
        return output.num_cached_tokens, output.outputs[0].token_ids

    unsalted, answer = run()
    assert unsalted == 0
    assert run("tenant-a") == (0, answer)  # the shared cache's blocks are not tenant a's
    assert run("tenant-b") == (0, answer)  # nor tenant a's tenant b's
    assert run("tenant-a") == (36, answer)  # each finds its own
    assert run()[0] == 36
    with pytest.raises(ValueError, match="cache_salt: must be a non-empty string"):
        llm.generate([{"prompt_token_ids": ids, "cache_salt": ""}], params, use_tqdm=False)
