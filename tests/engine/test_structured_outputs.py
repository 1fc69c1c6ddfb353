"""Structured outputs through ``LLM.generate``: every constrained answer parses and validates,
on a tiny random model (which never writes valid JSON by chance) and on SmolLM2."""

import json
import re
import threading
import time

import jsonschema
import pytest
from engine_helpers import assert_idle_and_nothing_leaked
from schemas import PERSON

from actorlm import LLM, SamplingParams
from actorlm.core.structured_output import GrammarCompiler
from actorlm.sampling_params import StructuredOutputsParams


def constrained(seed, **constraint):
    return SamplingParams(max_tokens=160, temperature=1.0, seed=seed,
                          structured_outputs=StructuredOutputsParams(**constraint))


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32") as llm:
        yield llm


def test_fifty_json_schema_answers_all_validate(tiny):
    outputs = tiny.generate([f"Person {i}:" for i in range(50)],
                            [constrained(i, json=PERSON) for i in range(50)], use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert len({o.outputs[0].text for o in outputs}) > 40  # sampled, not one canned answer
    assert_idle_and_nothing_leaked(tiny)


def test_regex_choice_and_grammar(tiny):
    cases = [(dict(regex=r"[0-9]{3}-[a-z]{2,4}"),
              lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
             (dict(choice=["left", "right", "up"]), lambda t: t in ("left", "right", "up")),
             (dict(grammar='root ::= "(" [a-c]+ ")"'), lambda t: re.fullmatch(r"\([a-c]+\)", t))]
    for constraint, valid in cases:
        outputs = tiny.generate(["Answer:"] * 10, [constrained(i, **constraint) for i in range(10)],
                                use_tqdm=False)
        for output in outputs:
            assert valid(output.outputs[0].text), (constraint, output.outputs[0].text)


def test_a_structural_tag_constrains_only_what_its_trigger_opens(tiny_llama_dir):
    """vLLM's first structural tag (``structures`` and ``triggers``): free text, in which each
    trigger opens its structure, whose JSON must follow the schema up to its end; the same as
    xgrammar's ``triggered_tags`` format it became. Checked by what the compiled grammar
    accepts, since a random model seldom writes the trigger by itself."""
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    legacy = {"structures": [{"begin": "<fn=weather>", "schema": schema, "end": "</fn>"}],
              "triggers": ["<fn="]}
    xgrammar_format = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<fn="], "tags": [
            {"begin": "<fn=weather>", "end": "</fn>",
             "content": {"type": "json_schema", "json_schema": schema}}]}}

    def accepts(tag: dict, text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiler.compile(
            StructuredOutputsParams(structural_tag=tag)), terminate_without_stop_token=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(t) for t in ids) and matcher.is_completed()

    for tag in (legacy, xgrammar_format):
        assert accepts(tag, 'Let me see. <fn=weather>{"city": "Paris"}</fn> Done.')
        assert accepts(tag, "No call at all.")
        assert not accepts(tag, '<fn=weather>{"town": "Paris"}</fn>')  # (its schema)
        assert not accepts(tag, '<fn=time>{"city": "Paris"}</fn>')  # (no such structure)
    with pytest.raises(ValueError, match="structural_tag: each of its structures needs a begin"):
        compiler.compile(StructuredOutputsParams(structural_tag={"structures": [{"begin": "<"}],
                                                                 "triggers": ["<"]}))
    with pytest.raises(ValueError, match="structured_outputs.structural_tag: must be a JSON "
                                         "object"):
        StructuredOutputsParams(structural_tag="[1, 2]")
    compiler.shutdown()


@pytest.mark.slow
def test_smollm2_answers_validate(smollm2_dir):
    """A real model, chatting: schemas, any JSON object, a regex and a choice."""
    schema = {**PERSON, "properties": {**PERSON["properties"],
                                       "name": {"type": "string", "maxLength": 20}}}
    people = [[{"role": "user", "content": f"Invent person number {i} as JSON."}]
              for i in range(50)]
    with LLM(str(smollm2_dir)) as llm:
        outputs = llm.chat(people, [constrained(i, json=schema) for i in range(50)],
                           use_tqdm=False)
        for output in outputs:
            jsonschema.validate(json.loads(output.outputs[0].text), schema)
        cities = [[{"role": "user", "content": f"{city} as a JSON object with its country."}]
                  for city in ("Paris", "Lyon", "Rome", "Oslo", "Lima")]
        anything = llm.chat(cities, SamplingParams(
            max_tokens=200, temperature=0.0,
            structured_outputs=StructuredOutputsParams(json_object=True)), use_tqdm=False)
        # any object is allowed, so a small model may run on past max_tokens (greedy, it
        # loops over ever longer keys for one to four of these five, depending on which side
        # of its near-ties the arithmetic falls); every one it finishes is a JSON object
        finished = [o.outputs[0].text for o in anything if o.outputs[0].finish_reason == "stop"]
        assert finished and all(isinstance(json.loads(t), dict) for t in finished)
        question = [[{"role": "user", "content": "Is Paris in France? Answer yes or no."}]]
        [choice] = llm.chat(question, constrained(0, choice=["yes", "no"]), use_tqdm=False)
        assert choice.outputs[0].text in ("yes", "no")
        [date] = llm.chat([[{"role": "user", "content": "When did the Bastille fall?"}]],
                          constrained(0, regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), use_tqdm=False)
        assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.outputs[0].text)


def test_unconstrained_neighbours_are_unchanged(tiny):
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["The first", "A second one", "And a third"]
    alone = [o.outputs[0].token_ids for o in tiny.generate(prompts, plain, use_tqdm=False)]
    mixed = tiny.generate(prompts + ["Person:"] * 3,
                          [plain] * 3 + [constrained(i, json=PERSON) for i in range(3)],
                          use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for output in mixed[3:]:
        jsonschema.validate(json.loads(output.outputs[0].text), PERSON)


def test_a_bad_constraint_fails_its_request_alone(tiny):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    bad, good = tiny.generate(["x", "y"], [constrained(0, grammar="root ::= undefined_rule"),
                                          SamplingParams(max_tokens=4)], use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and "structured_outputs" in bad.error
    assert bad.error_field == "structured_outputs"  # the client's field, not an engine fault
    assert good.outputs[0].finish_reason == "length" and good.error_field is None
    assert_idle_and_nothing_leaked(tiny)


def test_a_slow_grammar_compiles_while_others_keep_running(tiny, tiny_llama_dir):
    """A schema that takes a while to compile holds back only its own request."""
    from transformers import AutoConfig, AutoTokenizer

    slow = StructuredOutputsParams(json={"type": "object", "properties": {
        f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}x{i}$"}
        for i in range(1000)}})
    # how long it takes alone, with a compiler of its own (nothing cached)
    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_llama_dir),
                               AutoConfig.from_pretrained(tiny_llama_dir).vocab_size)
    start = time.monotonic()
    compiler.compile(slow)
    compile_s = time.monotonic() - start
    compiler.shutdown()
    assert compile_s > 0.5, compile_s  # slow enough to see

    stop = threading.Event()

    def keep_talking():  # one short plain request after another
        while not stop.is_set():
            tiny.generate(["Go on"], SamplingParams(max_tokens=32, temperature=0.0,
                                                    ignore_eos=True), use_tqdm=False)

    talker = threading.Thread(target=keep_talking, daemon=True)
    talker.start()
    constrained_done = threading.Event()
    threading.Thread(target=lambda: (tiny.generate(["Fields:"], SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs=slow), use_tqdm=False),
        constrained_done.set()), daemon=True).start()
    before = tiny.stats()["num_scheduled_tokens"]
    time.sleep(compile_s / 2)
    during = tiny.stats()["num_scheduled_tokens"]
    # the constrained request still waits for its grammar while the others keep decoding
    assert not constrained_done.is_set()
    assert during - before >= 10, (before, during)
    assert constrained_done.wait(60)
    stop.set()
    talker.join(60)


SMALL = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}


def _free_whitespace(text: str) -> bool:
    """Whether a JSON text has whitespace between its tokens beyond the fixed separators
    ``", "`` and ``": "`` (its strings left out)."""
    between = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return bool(re.search(r"\s", between.replace(", ", ",").replace(": ", ":")))


def test_vllms_structured_outputs_config_may_let_whitespace_in(tiny, tiny_llama_dir):
    """JSON with fixed separators by default; ``disable_any_whitespace: false`` lets any
    whitespace between the tokens, as vLLM's xgrammar grammars do (a random model then wanders
    in it: the answers that end validate)."""
    params = [constrained(i, json=SMALL) for i in range(24)]
    compact = [o.outputs[0].text for o in tiny.generate(["Point:"] * 24, params,
                                                         use_tqdm=False)]
    assert not any(map(_free_whitespace, compact))
    with LLM(str(tiny_llama_dir), dtype="float32", structured_outputs_config={
            "backend": "xgrammar", "disable_any_whitespace": False}) as spaced_llm:
        spaced = [o.outputs[0] for o in spaced_llm.generate(["Point:"] * 24, params,
                                                            use_tqdm=False)]
    ended = [c.text for c in spaced if c.finish_reason == "stop"]
    for text in ended:
        jsonschema.validate(json.loads(text), SMALL)
    assert ended and any(_free_whitespace(c.text) for c in spaced)


@pytest.mark.parametrize("config, said", [
    ({"backend": "outlines"}, "backend 'outlines' is not implemented"),
    ({"enable_in_reasoning": True}, "enable_in_reasoning is not implemented"),
    ({"disable_any_whitespace": "no"}, "disable_any_whitespace must be true or false"),
    ({"backnd": "xgrammar"}, "unknown field 'backnd'"),
    ({"reasoning_parser": "qwen3"}, "differs from --reasoning-parser 'deepseek_r1'"),
    ("{backend", "must be JSON")])
def test_a_structured_outputs_config_it_cannot_run_is_refused_by_name(config, said):
    from actorlm.config import EngineConfig

    with pytest.raises(ValueError, match=f"--structured-outputs-config.*{said}"):
        EngineConfig(structured_outputs_config=config, reasoning_parser="deepseek_r1")
    assert EngineConfig(structured_outputs_config={"reasoning_parser": "qwen3"}) \
        .reasoning_parser == "qwen3"
