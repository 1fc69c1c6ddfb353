"""Mixtures of experts from GGUF files through the whole engine: ``LLM`` on the file, prompts
prefilled in chunks and follow-ups starting from cached prefix blocks.

An F32 file gives transformers' greedy on its checkpoint (vLLM's ``check_logprobs_close``).
A file in blocks keeps its experts in them; its greedy tokens are the same whether prompts
prefill in chunks beside other requests or whole and alone (each row's activations are
quantized on their own, so a batch's composition changes no bit). How close a model in blocks
is to transformers over the same values is ``tests/models/test_moe_gguf.py``'s question: on
these tiny random models a token whose router scores two experts within the int8
activations' error may take either, and a greedy continuation then parts from transformers'
further than vLLM's rule allows.
"""

import pytest
from engine_helpers import TOP, check_logprobs_close, engine_greedy, hf_greedy
from gguf_moe_files import save_routed, write_moe_gguf

from actorlm import SamplingParams

SHARED = [7 + (j * 11) % 290 for j in range(18)]
PROMPTS = [SHARED, SHARED + [40, 90, 140], SHARED + [41, 91]]
NUM_TOKENS = 12


def _greedy():
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True,
                          logprobs=TOP)


def _chunked_with_prefix_hits(make_llm, file):
    # 8 tokens a step: the shared prompt prefills in 3 chunks; the follow-ups start from its
    # 4 full blocks
    llm = make_llm(str(file), block_size=4, max_model_len=64, max_num_batched_tokens=8)
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], _greedy(), use_tqdm=False)
    later = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], _greedy(),
                         use_tqdm=False)
    assert [o.num_cached_tokens for o in later] == [16, 16]
    return first + later


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_an_f32_moe_file_gives_transformers_greedy(family, make_llm, tmp_path_factory,
                                                   tiny_tokenizer_dir):
    checkpoint = save_routed(tmp_path_factory, tiny_tokenizer_dir, family)
    file = write_moe_gguf(checkpoint, tmp_path_factory.mktemp("gguf") / f"{family}.gguf", "F32")
    check_logprobs_close(engine_greedy(_chunked_with_prefix_hits(make_llm, file)),
                         hf_greedy(checkpoint, PROMPTS, NUM_TOKENS))


@pytest.mark.parametrize("family, type_name", [("qwen2_moe", "Q8_0"), ("mixtral", "Q4_0")])
def test_a_moe_file_in_blocks_gives_the_same_tokens_however_it_is_batched(
        family, type_name, make_llm, tmp_path_factory, tiny_tokenizer_dir):
    checkpoint = save_routed(tmp_path_factory, tiny_tokenizer_dir, family)
    file = write_moe_gguf(checkpoint, tmp_path_factory.mktemp("gguf") / f"{family}.gguf",
                          type_name)
    batched = _chunked_with_prefix_hits(make_llm, file)
    alone = make_llm(str(file), block_size=4, max_model_len=64, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in batched] == \
        [alone.generate([{"prompt_token_ids": p}], _greedy(), use_tqdm=False)[0]
         .outputs[0].token_ids for p in PROMPTS]
