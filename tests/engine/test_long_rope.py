"""A LongRoPE model (Phi-3.5's, Phi-4-mini's) served past its original context through the
whole engine, against transformers' greedy on the same weights: a prompt longer than the
original context turns by the long factors at every position, so its KV blocks are never
those a shorter prompt cached for the same tokens (tests/checkpoints.py's tiny Phi-3 with an
original context of 128 positions of 512)."""

from checkpoints import LONGROPE_CONTEXT
from engine_helpers import TOP, check_logprobs_close, engine_greedy, hf_greedy

from actorlm import SamplingParams

NUM_TOKENS = 24
SHORT = [5 + (j * 13) % 300 for j in range(LONGROPE_CONTEXT - 10)]  # decodes past 128
LONG = SHORT + [9 + (j * 7) % 280 for j in range(30)]  # 148 tokens: long factors throughout


def test_past_the_original_context_the_engine_gives_transformers_greedy(tiny_window_dirs,
                                                                        make_llm):
    path = tiny_window_dirs["phi3_longrope"]
    llm = make_llm(str(path), block_size=4, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=TOP)
    # one after the other, so that the long prompt finds the short one's blocks cached
    outputs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
               for p in (SHORT, LONG, LONG)]
    check_logprobs_close(engine_greedy(outputs), hf_greedy(path, [SHORT, LONG, LONG],
                                                           NUM_TOKENS))
    assert llm.engine.config.max_model_len == 512  # the whole context, not the original one
    short, long, again = (o.num_cached_tokens for o in outputs)
    assert short == 0 and long == 0  # the same first 118 tokens, turned by other factors
    assert again >= len(LONG) - 4  # a long prompt's blocks serve another long prompt
