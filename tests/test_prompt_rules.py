"""The prompt rules both doors apply (the frontend's ValueError, the API's 400): one wording."""

import pytest

from actorlm.prompt_rules import empty_prompt, outside_vocabulary


@pytest.mark.parametrize("token_ids, refused", [
    ([0, 5, 9], None),
    ([], None),
    ([0, 10], "token id 10 is outside the vocabulary [0, 10)"),
    ([3, -1, 11], "token id -1 is outside"),  # the first bad one is named
    ([1, True], "token id True is outside"),  # a bool is not a token id
    ([1, 2.0], "token id 2.0 is outside"),
    ([1, "2"], "token id '2' is outside"),
])
def test_outside_vocabulary_names_the_first_bad_token(token_ids, refused):
    found = outside_vocabulary("prompt", token_ids, 10)
    if refused is None:
        assert found is None
    else:
        assert found.startswith("prompt: " + refused)


def test_the_engine_and_the_api_refuse_in_the_rules_words(tiny_llama_dir):
    from actorlm.api import protocol as p
    from actorlm.llm import LLM

    with LLM(str(tiny_llama_dir), dtype="float32") as llm:
        vocab = llm.engine.hf_config.vocab_size
        with pytest.raises(ValueError) as engine:
            llm.generate([{"prompt_token_ids": [1, vocab]}], use_tqdm=False)
    assert str(engine.value) == outside_vocabulary("prompt_token_ids", [1, vocab], vocab)
    with pytest.raises(p.ApiError) as api:
        p.CompletionRequest(prompt=[]).prompts()
    assert api.value.message == empty_prompt("prompt") and api.value.status == 400
