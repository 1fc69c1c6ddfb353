"""``--speculative-config`` in vLLM's JSON shape: each method's keys, defaults, and an error
naming the key for anything else."""

import pytest

from actorlm.config import EngineConfig
from actorlm.speculative import SpeculativeConfig


def test_prompt_lookup_bounds_default_to_five_and_one_sets_the_other():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}') == \
        SpeculativeConfig("ngram", 3, 5, 5)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                    "prompt_lookup_max": 4}) == SpeculativeConfig("ngram", 2, 4, 4)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3}) == \
        SpeculativeConfig("ngram", 2, 1, 3)


def test_a_model_implies_the_draft_model_method_as_in_vllm():
    expected = SpeculativeConfig("draft_model", 4, model="path/to/draft")
    assert SpeculativeConfig.parse({"model": "path/to/draft", "num_speculative_tokens": 4}) == \
        expected
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "path/to/draft",
                                    "num_speculative_tokens": 4}) == expected
    config = EngineConfig(speculative_config='{"model": "d", "num_speculative_tokens": 1}')
    assert config.speculative_config == SpeculativeConfig("draft_model", 1, model="d")


@pytest.mark.parametrize("value, message", [
    ("{", "must be JSON"),
    ("[1]", "must be a JSON object"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "unknown key.*lookahead"),
    ({"num_speculative_tokens": 3}, "needs \"method\""),
    ({"method": "eagle", "model": "d", "num_speculative_tokens": 3}, "method 'eagle' is not"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a pos"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be a pos"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, r"prompt_lookup_min \(4\) exceeds prompt_lookup_max \(2\)"),
    ({"method": "ngram", "model": "d", "num_speculative_tokens": 2}, "'ngram' takes no"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"model": "", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "prompt_lookup_max belong to method 'ngram'"),
])
def test_anything_else_is_an_error_naming_the_key(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
