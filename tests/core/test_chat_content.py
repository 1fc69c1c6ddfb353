"""chat_content: a message's content handed to the chat template in the form it reads, the
form ``auto`` detects from the template as vLLM does."""

import pytest

from actorlm.chat_content import check_content_format, loops_over_content, with_content_format

PARTS = [{"type": "text", "text": "the cat"}, {"type": "text", "text": "sat"}]


@pytest.mark.parametrize("template, loops", [
    # Gemma 3's way: parts, or a string
    ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
     "{% for item in m['content'] %}{{ item['text'] }}{% endfor %}{% endif %}{% endfor %}", True),
    ("{% for m in messages %}{% for item in m.content %}{{ item.text }}{% endfor %}{% endfor %}",
     True),
    # through a variable, or a filter
    ("{% for m in messages %}{% set parts = m['content'] %}{% for p in parts %}{{ p.text }}"
     "{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}"
     "{{ p.text }}{% endfor %}{% endfor %}", True),
    # Llama 3's and SmolLM2's way: a string
    ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] | trim }}{% endfor %}",
     False),
    ("{% for m in messages %}{% set content = m['content'] %}{{ content }}{% endfor %}", False),
    ("{% for m in messages %}{{ m['content'] ", False),  # (not a template: rendering says so)
])
def test_a_template_that_loops_over_a_messages_content_reads_parts(template, loops):
    assert loops_over_content(template) is loops


def test_each_form_of_the_content():
    conversation = [{"role": "user", "content": PARTS}, {"role": "assistant", "content": "ok"},
                    {"role": "assistant", "content": "", "tool_calls": []}]
    as_string = with_content_format(conversation, "string", None)
    assert [m["content"] for m in as_string] == ["the cat\nsat", "ok", ""]
    as_parts = with_content_format(conversation, "openai", None)
    assert [m["content"] for m in as_parts] == [PARTS, [{"type": "text", "text": "ok"}], []]
    assert as_parts[2]["tool_calls"] == [] and conversation[1]["content"] == "ok"  # (a copy)
    looping = "{% for m in messages %}{% for p in m['content'] %}{% endfor %}{% endfor %}"
    assert with_content_format(conversation, "auto", looping) == as_parts
    assert with_content_format(conversation, "auto", "{{ messages }}") == as_string
    assert with_content_format(conversation, "auto", {"default": "x", "tool_use": looping}) \
        == as_parts
    with pytest.raises(ValueError, match="must be one of auto, string, openai, got 'parts'"):
        check_content_format("parts", "--chat-template-content-format")
