"""Generation controls against transformers (or the OpenAI/vLLM definitions where it has none)."""

import random

import pytest
import torch
from transformers import (AutoModelForCausalLM, LogitsProcessorList,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from actorlm import SamplingParams


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from actorlm.llm import LLM

    engine = LLM(str(tiny_llama_dir), dtype="float32", block_size=4)
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def no_leaks(llm):
    yield
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


def prompts(vocab=300, lengths=(5, 11, 3, 8)):
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run(llm, prompt_ids, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)


def hf_logits(model, token_ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()  # [L, V]


def reference_greedy(model, prompt, num_tokens, process):
    """Greedy decoding where ``process(ids, logits)`` edits the next-token logits first."""
    ids = list(prompt)
    for _ in range(num_tokens):
        logits = hf_logits(model, ids)[-1]
        ids.append(int(process(ids, logits.clone()).argmax()))
    return ids[len(prompt):]


def test_logprobs_match_log_softmax_of_transformers_logits(llm, hf_model):
    for prompt, out in zip(prompts(), run(llm, prompts(), SamplingParams(
            max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=3))):
        completion = out.outputs[0]
        ref = torch.log_softmax(hf_logits(hf_model, prompt + completion.token_ids), dim=-1)
        assert len(completion.logprobs) == 6
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert abs(entry[token].logprob - row[token].item()) <= 1e-4
            top = row.topk(5)
            assert set(entry) == {token} | set(top.indices.tolist())
            for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(entry[token_id].logprob - value) <= 1e-4
        assert abs(completion.cumulative_logprob -
                   sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs))) < 1e-5
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            entry = out.prompt_logprobs[i]
            assert abs(entry[prompt[i]].logprob - ref[i - 1, prompt[i]].item()) <= 1e-4
            assert entry[prompt[i]].rank == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1


def test_prompt_logprobs_survive_chunked_prefill(tiny_llama_dir, hf_model):
    from actorlm.llm import LLM

    prompt = prompts(lengths=(23,))[0]
    with LLM(str(tiny_llama_dir), dtype="float32", block_size=4,
             max_num_batched_tokens=6) as chunked:
        out = run(chunked, [prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    ref = torch.log_softmax(hf_logits(hf_model, prompt), dim=-1)
    got = [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
    want = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4


@pytest.mark.parametrize("name,params,process", [
    ("repetition", dict(repetition_penalty=1.5),
     lambda ids, lg: LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])(
         torch.tensor([ids]), lg[None])[0]),
    ("repetition<1", dict(repetition_penalty=0.7),
     lambda ids, lg: LogitsProcessorList([RepetitionPenaltyLogitsProcessor(0.7)])(
         torch.tensor([ids]), lg[None])[0]),
    ("logit_bias", dict(logit_bias={17: 4.0, 42: -3.0, 99: 2.5}),
     lambda ids, lg: SequenceBiasLogitsProcessor({(17,): 4.0, (42,): -3.0, (99,): 2.5})(
         torch.tensor([ids]), lg[None])[0]),
])
def test_penalties_and_bias_match_transformers_processors(llm, hf_model, name, params, process):
    p = prompts()
    outs = run(llm, p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **params))
    for prompt, out in zip(p, outs):
        assert out.outputs[0].token_ids == reference_greedy(hf_model, prompt, 12, process)
    assert_changed_something(llm, p, outs)


def assert_changed_something(llm, p, outs):
    plain = run(llm, p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in plain]


def openai_penalties(frequency, presence, prompt_len):
    """The OpenAI definition: logit -= count * frequency + (count > 0) * presence, where count
    is how often the token occurs in the output so far."""
    def process(ids, logits):
        counts = torch.bincount(torch.tensor(ids[prompt_len:], dtype=torch.long),
                                minlength=logits.numel()).float() if len(ids) > prompt_len \
            else torch.zeros_like(logits)
        return logits - counts * frequency - (counts > 0).float() * presence
    return process


@pytest.mark.parametrize("frequency,presence", [(1.5, 0.0), (0.0, 1.8), (2.0, -1.0)])
def test_frequency_and_presence_penalties_follow_the_openai_definition(llm, hf_model, frequency,
                                                                       presence):
    p = prompts()
    outs = run(llm, p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                      frequency_penalty=frequency, presence_penalty=presence))
    for prompt, out in zip(p, outs):
        expected = reference_greedy(hf_model, prompt, 12,
                                    openai_penalties(frequency, presence, len(prompt)))
        assert out.outputs[0].token_ids == expected
    assert_changed_something(llm, p, outs)


def test_allowed_tokens_bad_words_and_min_tokens(llm):
    p = prompts()
    plain = [o.outputs[0].token_ids for o in run(llm, p, SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True))]
    allowed = [5, 9, 77, 120]
    for out in run(llm, p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                          allowed_token_ids=allowed)):
        assert set(out.outputs[0].token_ids) <= set(allowed)
    # a stop token the model would emit early is held back until min_tokens are out
    stop = plain[0][1]
    early = run(llm, [p[0]], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop]))
    assert early[0].outputs[0].token_ids == plain[0][:2] and early[0].outputs[0].stop_reason == stop
    late = run(llm, [p[0]], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop],
                                           min_tokens=6))[0].outputs[0]
    assert len(late.token_ids) >= 6 and stop not in late.token_ids[:6]


def test_bad_words_never_appear(llm):
    tokenizer = llm.tokenizer
    p = prompts()
    plain = run(llm, p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    word = tokenizer.decode([plain[0].outputs[0].token_ids[0]]).strip()
    assert word, "the first greedy token should decode to a visible word"
    outs = run(llm, p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                      bad_words=[word]))
    banned = {ids[-1] for ids in ([tokenizer.encode(w, add_special_tokens=False)
                                   for w in (word, " " + word)]) if len(ids) == 1}
    assert banned and all(not banned & set(o.outputs[0].token_ids) for o in outs)


def test_same_seed_same_tokens_alone_or_in_a_batch_of_32(llm):
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234,
                            ignore_eos=True)
    target = prompts()[1]
    alone = run(llm, [target], seeded)[0].outputs[0].token_ids
    rng = random.Random(3)
    others = [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 20))] for _ in range(31)]
    mixed = [SamplingParams(max_tokens=rng.randrange(4, 16), temperature=rng.choice([0.0, 0.7, 1.3]),
                            ignore_eos=True) for _ in others]
    batch = llm.generate([{"prompt_token_ids": q} for q in others[:15] + [target] + others[15:]],
                         mixed[:15] + [seeded] + mixed[15:], use_tqdm=False)
    assert batch[15].outputs[0].token_ids == alone
    unseeded = run(llm, [target] * 2, SamplingParams(max_tokens=12, temperature=1.0,
                                                     ignore_eos=True))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n4_returns_four_distinct_completions_and_prefills_once(llm):
    prompt = prompts(lengths=(30,))[0]
    llm.reset_prefix_cache()  # earlier tests computed this prompt: forget it
    before = llm.stats()["num_scheduled_tokens"]
    out = run(llm, [prompt], SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=5,
                                            ignore_eos=True))[0]
    scheduled = llm.stats()["num_scheduled_tokens"] - before
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    # one prefill; each sibling finds the prompt's full blocks cached and computes only the
    # partial last block (block_size 4)
    tail = len(prompt) - (len(prompt) - 1) // 4 * 4
    assert scheduled == len(prompt) + 3 * tail + 4 * 7


def test_stop_string_finishes_the_request_and_frees_its_blocks(llm):
    p = prompts()[:1]
    plain = run(llm, p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    text = plain.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    out = run(llm, p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                     stop=[stop]))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:text.find(stop)], "stop", stop)
    assert len(out.token_ids) < 16


@pytest.mark.parametrize("incrementally", [False, True], ids=["at_the_end", "token_by_token"])
def test_the_token_that_stops_the_engine_is_no_part_of_the_text(llm, incrementally):
    """vLLM's rule: a stop token id's (or EOS's) token ends the answer's token ids, not its
    text, unless include_stop_str_in_output; with skip_special_tokens false too. (A stop
    string, which never matches here, makes the text come token by token.)"""
    p = prompts()[:1]
    plain = run(llm, p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    words = plain.outputs[0].token_ids
    stop_at = next(i for i, t in enumerate(words) if llm.engine.tokenizer.decode([t]).strip())
    token = words[stop_at]
    streamed = {"stop": ["\x00never"]} if incrementally else {}
    for include in (False, True):
        out = run(llm, p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                         stop_token_ids=[token], skip_special_tokens=False,
                                         include_stop_str_in_output=include,
                                         **streamed))[0].outputs[0]
        assert out.token_ids == words[:stop_at + 1] and out.stop_reason == token
        kept = words[:stop_at + 1] if include else words[:stop_at]
        assert out.text == llm.engine.tokenizer.decode(kept)


def test_a_top_k_past_the_vocabulary_keeps_every_token(llm):
    """vLLM takes any top_k; one past 32 bits (what the sampling kernels hold) must mean what
    one past the vocabulary means, every token kept, not fail the step (a fuzzed request's)."""
    p = prompts()
    kept = [SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, top_k=k)
            for k in (0, len(llm.tokenizer) + 1, 2**40)]
    outputs = [[o.outputs[0].token_ids for o in run(llm, p, params)] for params in kept]
    assert outputs[0] == outputs[1] == outputs[2]


def test_chat_continues_an_open_final_message(llm, tiny_llama_dir):
    from transformers import AutoTokenizer

    conversation = [{"role": "user", "content": "Tell me a story"},
                    {"role": "assistant", "content": "Once upon"}]
    ids = AutoTokenizer.from_pretrained(tiny_llama_dir).apply_chat_template(
        conversation, tokenize=True, return_dict=True, continue_final_message=True)["input_ids"]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    [chat] = llm.chat(conversation, greedy, use_tqdm=False, add_generation_prompt=False,
                      continue_final_message=True)
    [plain] = run(llm, [ids], greedy)
    assert chat.prompt_token_ids == ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(conversation, greedy, use_tqdm=False, continue_final_message=True)
