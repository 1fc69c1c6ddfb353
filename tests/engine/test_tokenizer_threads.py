"""PerThreadTokenizer: each thread encodes and decodes on a copy of its own, with the results
of the one tokenizer, however many threads use it at once; and a tokenizer in place of the
model's own (``--tokenizer``)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from actorlm.sampling_params import SamplingParams
from actorlm.tokenizer import PerThreadTokenizer

TEXT = "Once upon a time there was a small village at the edge of a great forest. " * 40


def test_every_thread_gets_its_own_copy_and_the_same_answers(tiny_tokenizer_dir):
    reference = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    shared = PerThreadTokenizer(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    conversation = [{"role": "user", "content": TEXT[:500]}]
    expected = (reference.encode(TEXT), reference.decode(reference.encode(TEXT)[::3]),
                reference.apply_chat_template(conversation, tokenize=True),
                reference(TEXT, truncation=True, max_length=17)["input_ids"])
    start = threading.Barrier(8)

    def work(_) -> tuple:
        start.wait()  # all at once
        answers = set()
        for _ in range(20):
            ids = shared.encode(TEXT)
            # truncation settings change the Rust tokenizer's state: the classic race
            answers.add((tuple(ids), shared.decode(ids[::3]),
                         tuple(shared.apply_chat_template(conversation, tokenize=True)),
                         tuple(shared(TEXT, truncation=True, max_length=17)["input_ids"])))
        return id(shared.for_this_thread), answers

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(work, range(8)))
    assert len({copy_id for copy_id, _ in results}) == 8  # one copy per thread
    for _, answers in results:
        assert answers == {(tuple(expected[0]), expected[1], tuple(expected[2]),
                            tuple(expected[3]))}
    assert len(shared) == len(reference) and shared.eos_token_id == reference.eos_token_id


@pytest.mark.parametrize("engine_core_process", [False, True])
def test_a_tokenizer_of_its_own_renders_and_reads_for_the_model(tiny_llama_dir, tmp_path,
                                                                make_llm, engine_core_process):
    """``--tokenizer``: the engine encodes, renders chats and detokenizes with the named
    tokenizer (here the model's own with another chat template), in its process or beside an
    engine core of its own; no tokenizer there, or one with more tokens than the model's
    vocabulary, is refused naming the flag."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.chat_template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "own")
    llm = make_llm(str(tiny_llama_dir), tokenizer=str(tmp_path / "own"), num_kv_blocks=64,
                   engine_core_process=engine_core_process)
    conversation = [{"role": "user", "content": "Once upon a time"}]
    assert llm.apply_chat_template(conversation) == \
        tokenizer.encode("<<Once upon a time>>", add_special_tokens=False)
    own = llm.get_tokenizer()  # (vLLM scripts render their prompts with it)
    assert isinstance(own, PreTrainedTokenizerBase) and own.chat_template == tokenizer.chat_template
    assert own.apply_chat_template(conversation, tokenize=False) == "<<Once upon a time>>"
    params = SamplingParams(max_tokens=4, temperature=0.0)
    [out] = llm.generate(["Once upon a time"], params)
    assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids,
                                                   skip_special_tokens=True)
    if engine_core_process:
        return
    with pytest.raises(ValueError, match="--tokenizer .*missing.*: no tokenizer there"):
        make_llm(str(tiny_llama_dir), tokenizer=str(tmp_path / "missing"), num_kv_blocks=64)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(len(tokenizer) + 1)])
    tokenizer.save_pretrained(tmp_path / "larger")
    with pytest.raises(ValueError, match=r"--tokenizer .*larger.* has \d+ tokens, more than "
                                         r"the model's vocabulary \(\d+\)"):
        make_llm(str(tiny_llama_dir), tokenizer=str(tmp_path / "larger"), num_kv_blocks=64)
