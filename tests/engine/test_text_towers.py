"""A multimodal checkpoint served by its text decoder, as a newcomer runs one: ``LLM(dir)``
and ``chat``, its chat template read from the processor's ``chat_template.json`` where the
tokenizer has none (Qwen2.5-VL's layout), in process and with the engine core in its own."""

from __future__ import annotations

import json

import pytest
from checkpoints import save_multimodal
from greedy import hf_continuation

from actorlm import SamplingParams

# (a template unlike the tokenizer's own ChatML one: the test tells which one rendered)
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
CONVERSATION = [{"role": "user", "content": "the cat sat on the mat"}]


@pytest.fixture(scope="module")
def qwen_vl_dir(tiny_window_dirs, tmp_path_factory):
    """A tiny Qwen2.5-VL whose tokenizer has no chat template, its processor's file one."""
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    save_multimodal("qwen2_5_vl", tiny_window_dirs["mistral"], path)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    (path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return path


@pytest.mark.parametrize("engine_core_process", [False, True], ids=["in-process", "core-process"])
def test_a_vision_language_checkpoint_chats_through_its_processors_template(
        make_llm, qwen_vl_dir, engine_core_process):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(qwen_vl_dir)
    assert tokenizer.chat_template is None
    expected_prompt = tokenizer.encode("[user] the cat sat on the mat\n[assistant] ",
                                       add_special_tokens=False)
    llm = make_llm(str(qwen_vl_dir), engine_core_process=engine_core_process)
    assert llm.apply_chat_template(CONVERSATION) == expected_prompt
    out = llm.chat(CONVERSATION, SamplingParams(max_tokens=12, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False)[0]
    theirs = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_vl_dir).eval()
    tokens, _ = hf_continuation(theirs, expected_prompt, 12)
    assert out.prompt_token_ids == expected_prompt
    assert out.outputs[0].token_ids == tokens


def test_an_image_in_a_conversation_is_refused_by_name(make_llm, qwen_vl_dir):
    llm = make_llm(str(qwen_vl_dir))
    image = [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\].content: only text parts are "
                                         r"supported, got 'image_url'"):
        llm.chat(image, use_tqdm=False)
    text = [{"role": "user", "content": [{"type": "text", "text": "the cat"}]}]
    assert llm.chat(text, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
