"""Recorded runs shared by the trace tests: a real (tiny) model and a fake-runner engine."""

from __future__ import annotations

import queue
import random
import shutil
from types import SimpleNamespace

import pytest
from actor_hygiene import no_actor_outlives_its_test  # noqa: F401  (autouse)

from actorlm import LLM, SamplingParams
from actorlm.messages import AbortRequests, SubmitRequest
from actorlm.trace import read_jsonl


class AbortAfter:
    """A streaming sink that aborts its request after ``num_outputs`` outputs, as a client
    that disconnects mid-stream does."""

    def __init__(self, frontend, request_id: str, num_outputs: int):
        self.frontend, self.request_id, self.num_outputs = frontend, request_id, num_outputs
        self.count, self.final = 0, queue.Queue()

    def put(self, output) -> None:
        self.count += 1
        if self.count == self.num_outputs:
            self.frontend.tell(AbortRequests([self.request_id]))
        if output.finished:
            self.final.put(output)


def clean_prefix(text: str) -> str:
    """The start of ``text`` before any undecodable byte or control character (a random model
    writes such bytes, and the detokenizer holds text back around them)."""
    for index, char in enumerate(text):
        if not (char.isascii() and char.isprintable()):
            return text[:index]
    return text


def pick_stop_string(text: str) -> str:
    """A four-character piece of the clean start of ``text`` that first occurs in its second
    half (so the stop hits mid-generation, not at the first tokens)."""
    clean = clean_prefix(text)
    for start in range(len(clean) // 2, len(clean) - 3):
        piece = clean[start:start + 4]
        if piece.strip() == piece and text.find(piece) == start:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.fixture(scope="session")
def tiny_run(tiny_llama_dir, tmp_path_factory):
    """An offline run of the tiny Llama under KV pressure (preemptions), traced to a file:
    two generate calls, a request aborted mid-stream, one stopped by a stop string, n = 2."""
    path = tmp_path_factory.mktemp("trace") / "tiny_run.jsonl"
    rng = random.Random(7)
    with LLM(str(tiny_llama_dir), trace_file=str(path), dtype="float32", num_kv_blocks=24,
             block_size=4, max_model_len=96, max_num_batched_tokens=48, max_num_seqs=6) as llm:
        probes = [[rng.randrange(5, 300) for _ in range(9)] for _ in range(16)]
        texts = [o.outputs[0].text for o in llm.generate(
            [{"prompt_token_ids": p} for p in probes],
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)]
        best = max(range(len(probes)), key=lambda i: len(clean_prefix(texts[i])))
        probe, stop = probes[best], pick_stop_string(texts[best])
        victim = AbortAfter(llm.engine.frontend, "victim", 3)
        llm.engine.frontend.ask(SubmitRequest(
            "victim", [rng.randrange(5, 300) for _ in range(20)],
            SamplingParams(max_tokens=60, temperature=0.0), victim, True))
        prompts = [{"prompt_token_ids": probe}]
        params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])]
        for i in range(10):
            prompts.append({"prompt_token_ids": [rng.randrange(5, 300)
                                                 for _ in range(rng.randrange(3, 30))]})
            params.append(SamplingParams(max_tokens=rng.randrange(5, 40), temperature=0.0,
                                         n=2 if i == 4 else 1))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        at_return = read_jsonl(path)  # generate has returned: the file must be complete
        aborted = victim.final.get(timeout=60)
        stats = llm.stats()
    return SimpleNamespace(path=path, records=read_jsonl(path), at_return=at_return,
                           stats=stats, outputs=outputs, aborted=aborted, stop=stop)


@pytest.fixture(scope="session")
def chromium():
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path is not None, "chromium is not installed: make install installs it"
    return path
