"""SamplingParams refuses numbers the engine cannot carry: integers past 64 bits (msgpack and
torch hold no more) and floats that are not finite, each with a ValueError naming the field."""

from __future__ import annotations

import math
import re

import msgspec
import pytest

from actorlm.sampling_params import SamplingParams

INT64_MAX = 2**63 - 1


def _with(field: str, x: int) -> dict:
    """Keyword arguments that put x in ``field`` and are otherwise valid for x = INT64_MAX."""
    if field in ("stop_token_ids", "allowed_token_ids"):
        return {field: [x]}
    if field == "logit_bias":
        return {field: {x: 1.0}}
    if field == "min_tokens":
        return {field: x, "max_tokens": None}  # min_tokens must not exceed max_tokens
    return {field: x}


INT_FIELDS = ["n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
              "stop_token_ids", "allowed_token_ids", "logit_bias"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "logit_bias"]


@pytest.mark.parametrize("x", [2**63, -2**63 - 1, 10**29, -2**70], ids=str)
@pytest.mark.parametrize("field", INT_FIELDS)
def test_integer_past_64_bits_is_refused_naming_the_field(field, x):
    with pytest.raises(ValueError, match=rf"^{field}: must fit in 64 bits"):
        SamplingParams(**_with(field, x))


@pytest.mark.parametrize("field", INT_FIELDS)
def test_largest_int64_is_accepted_and_survives_msgpack(field):
    params = SamplingParams(**_with(field, INT64_MAX))
    # the trace recorder and the worker processes encode params as msgpack
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params


def test_smallest_int64_seed_is_accepted():
    assert SamplingParams(seed=-2**63).seed == -2**63


def test_refusal_of_a_huge_int_still_names_the_field():
    # str() of an int past 4300 digits raises ValueError itself; the message must not need it
    with pytest.raises(ValueError, match=r"^seed: must fit in 64 bits.*of 16610 bits"):
        SamplingParams(seed=10**5000)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=str)
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_non_finite_float_is_refused_naming_the_field(field, value):
    kwargs = {field: {7: value}} if field == "logit_bias" else {field: value}
    with pytest.raises(ValueError, match=rf"^{field}: .*finite"):
        SamplingParams(**kwargs)


def test_in_range_values_pass_and_keep_their_types():
    params = SamplingParams(n=3, top_k=50, seed=-7, max_tokens=8, min_tokens=2, logprobs=5,
                            prompt_logprobs=0, stop_token_ids=[2], allowed_token_ids=[1, 2],
                            logit_bias={"3": 5}, repetition_penalty=1.5, temperature=0.0)
    assert params.logit_bias == {3: 5.0}
    assert params.is_greedy and params.seed == -7


@pytest.mark.parametrize("constraint,message", [
    (dict(json=5), "structured_outputs.json: must be a JSON Schema"),
    (dict(json="[1, 2"), "structured_outputs.json: not valid JSON"),
    (dict(json_object="yes"), "structured_outputs.json_object: must be true or false"),
    (dict(regex=3), "structured_outputs.regex: must be a string"),
    (dict(choice="ab"), "structured_outputs.choice: must be a list of strings"),
    (dict(choice=[]), "structured_outputs.choice: must be a non-empty list"),
    (dict(grammar=""), "structured_outputs.grammar: must not be empty"),
    (dict(), "set exactly one"),
    (dict(regex="a", choice=["b"]), "set exactly one"),
], ids=str)
def test_a_malformed_constraint_is_refused_naming_the_field(constraint, message):
    from actorlm.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**constraint)


def test_vllms_older_names_of_a_constraint_still_constrain():
    """``GuidedDecodingParams`` as ``guided_decoding`` (vLLM's names before
    ``structured_outputs``): the same constraint."""
    from actorlm.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert params.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])
    assert params.guided_decoding is None
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+"),
                       structured_outputs=StructuredOutputsParams(regex="b+"))
