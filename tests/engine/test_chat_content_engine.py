"""A conversation's content reaches the chat template in the form the template reads
(``LLM.chat``'s ``chat_template_content_format``, vLLM's): parts for a template that loops over
them, a string for one that concatenates it, whatever form the caller sent."""

import pytest

from actorlm.sampling_params import SamplingParams

LOOPING = ("{% for m in messages %}[{% for p in m['content'] %}{{ p['text'] }}|{% endfor %}]"
           "{% endfor %}")
STRING = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
CONVERSATION = [{"role": "user", "content": [{"type": "text", "text": "the cat"},
                                             {"type": "text", "text": "sat"}]},
                {"role": "assistant", "content": "on the mat"}]


@pytest.mark.parametrize("template, content_format, rendered", [
    (LOOPING, "auto", "[the cat|sat|][on the mat|]"),
    (STRING, "auto", "[the cat\nsat][on the mat]"),
    (STRING, "openai", "[[{'type': 'text', 'text': 'the cat'}, {'type': 'text', 'text': 'sat'}]]"
                       "[[{'type': 'text', 'text': 'on the mat'}]]")])
def test_the_template_gets_the_content_in_its_form(make_llm, tiny_llama_dir, template,
                                                   content_format, rendered):
    llm = make_llm(str(tiny_llama_dir), num_kv_blocks=64)
    [out] = llm.chat(CONVERSATION, SamplingParams(max_tokens=1), use_tqdm=False,
                     chat_template=template, chat_template_content_format=content_format)
    assert out.prompt_token_ids == llm.get_tokenizer().encode(rendered, add_special_tokens=False)
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        llm.chat(CONVERSATION, chat_template_content_format="list", use_tqdm=False)
