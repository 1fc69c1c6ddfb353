"""PerThreadTokenizer: each thread encodes and decodes on a copy of its own, with the results
of the one tokenizer, however many threads use it at once."""

import threading
from concurrent.futures import ThreadPoolExecutor

from transformers import AutoTokenizer

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
