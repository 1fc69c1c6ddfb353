"""AsyncLLM on its own: the hand-off from the actors to asyncio, aborts, faults, shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from actorlm.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError
from actorlm.sampling_params import RequestOutputKind, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    llm = AsyncLLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=256)
    yield llm
    llm.shutdown()


def _wait_idle(engine: AsyncLLM, within: float = 2.0) -> dict:
    deadline = time.monotonic() + within
    while True:
        stats = engine.stats()
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0
                and stats["num_free_blocks"] == stats["num_total_blocks"]) \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_generate_streams_cumulative_outputs(engine):
    async def main():
        return [out async for out in engine.generate("Once upon a time", GREEDY)]

    outputs = asyncio.run(main())
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths) and lengths[-1] == 8 and len(outputs) >= 2
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert all(outputs[-1].outputs[0].text.startswith(o.outputs[0].text) for o in outputs)
    assert outputs[-1].prompt_token_ids == engine.encode("Once upon a time")


def test_output_kinds_stream_deltas_or_the_final_output_alone(engine):
    """vLLM's ``output_kind``: DELTA streams what each step added (which joins into the
    cumulative answer, logprobs and all), FINAL_ONLY the last output alone."""
    params = dict(max_tokens=8, temperature=0.0, ignore_eos=True, n=2, logprobs=1)

    async def collect(kind):
        sp = SamplingParams(**params, output_kind=kind)
        return [out async for out in engine.generate("Once upon a time", sp)]

    cumulative, delta, final = (asyncio.run(collect(kind)) for kind in RequestOutputKind)
    assert len(delta) == len(cumulative) >= 2 and len(final) == 1
    assert final[0].outputs == cumulative[-1].outputs and final[0].finished
    for index in range(2):
        pieces = [c for out in delta for c in out.outputs if c.index == index]
        whole = cumulative[-1].outputs[index]
        assert "".join(c.text for c in pieces) == whole.text
        assert [t for c in pieces for t in c.token_ids] == whole.token_ids
        assert [lp for c in pieces for lp in c.logprobs] == whole.logprobs
        assert pieces[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="output_kind: must be a RequestOutputKind, got 3"):
        SamplingParams(output_kind=3)


def test_concurrent_generates_match_one_at_a_time(engine):
    prompts = [f"The quick brown fox {i}" for i in range(12)]

    async def final(prompt):
        async for out in engine.generate(prompt, GREEDY):
            last = out
        return last.outputs[0].text

    async def main():
        alone = [await final(p) for p in prompts]
        together = await asyncio.gather(*(final(p) for p in prompts))
        return alone, together

    alone, together = asyncio.run(main())
    assert alone == list(together)


def test_leaving_the_loop_aborts(engine):
    async def main():
        async for out in engine.generate("Once upon a time", LONG, request_id="leave"):
            if len(out.outputs[0].token_ids) >= 3:
                break

    asyncio.run(main())
    stats = _wait_idle(engine)
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_cancelling_the_consumer_aborts(engine):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate("Once upon a time", LONG):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    stats = _wait_idle(engine)
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_bad_input_raises_value_error(engine):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("empty", "", GREEDY)
        with pytest.raises(ValueError, match="vocabulary"):
            await engine.add_request("oov", [1, 10**6], GREEDY)
        stream = await engine.add_request("dup", "Hello", LONG)
        try:
            with pytest.raises(ValueError, match="already in use"):
                await engine.add_request("dup", "Hello", LONG)
        finally:
            stream.abort()

    asyncio.run(main())
    assert engine.is_ready and _wait_idle(engine)["num_running"] == 0


def test_fault_and_shutdown_fail_live_requests(tiny_llama_dir):
    engine = AsyncLLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    try:
        async def main():
            stream = await engine.add_request("victim", "Once upon a time", LONG)
            await stream.__anext__()
            engine.engine.executor.stop()  # a worker-side actor dies
            assert engine.check_health() is not None and not engine.is_ready
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                await engine.add_request("late", "Hello", GREEDY)

        asyncio.run(main())
    finally:
        engine.shutdown()
    assert engine.check_health() == "the engine is shutting down"


def test_max_num_waiting_refuses_when_the_queue_is_full(tiny_llama_dir):
    engine = AsyncLLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=1,
                      max_num_waiting=1)
    try:
        async def main():
            running = await engine.add_request("a", "Once upon a time", LONG)
            waiting = await engine.add_request("b", "Once upon a time", LONG)
            with pytest.raises(EngineOverloadedError, match="overloaded"):
                await engine.add_request("c", "Hello", GREEDY)
            running.abort()
            async for _ in waiting:  # the waiting one gets the slot
                break
            waiting.abort()

        asyncio.run(main())
        assert _wait_idle(engine)["num_running"] == 0
    finally:
        engine.shutdown()

    with pytest.raises(ValueError, match="--max-num-waiting"):
        AsyncLLM(str(tiny_llama_dir), max_num_waiting=0)


def test_a_dead_worker_is_replaced_and_counted_and_its_stream_completes(tiny_llama_dir):
    from prometheus_client.parser import text_string_to_metric_families

    from actorlm.api.metrics import ServerMetrics

    engine = AsyncLLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    metrics = ServerMetrics("tiny", lambda: engine)
    try:
        async def main():
            stream = await engine.add_request("survivor", "Once upon a time", LONG)
            first = await stream.__anext__()
            engine.engine.executor.proxy().workers.get()[0].stop()  # the worker's thread ends
            async for last in stream:
                pass
            return first, last

        first, last = asyncio.run(main())
        assert len(first.outputs[0].token_ids) >= 1 and last.finished and not last.error
        assert last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 400
        assert engine.is_ready and engine.stats()["num_worker_restarts"] == 1
        samples = {s.name: s.value for family in text_string_to_metric_families(
            metrics.render().decode()) for s in family.samples}
        assert samples["actorlm:worker_restarts_total"] == 1
    finally:
        engine.shutdown()


def test_the_submit_thread_has_its_tokenizer_before_the_first_request(tiny_llama_dir,
                                                                   monkeypatch):
    import copy
    import threading

    llm = AsyncLLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    try:
        copied_in = []
        real = copy.deepcopy

        def counting(obj, *args):
            copied_in.append(threading.current_thread().name)
            return real(obj, *args)

        monkeypatch.setattr(copy, "deepcopy", counting)
        # the server's chat templates and /tokenize run there (``run_blocking``)
        ids = asyncio.run(llm.run_blocking(llm.encode, "Hello"))
        assert ids and ids == llm.tokenizer.encode("Hello")
        assert not [name for name in copied_in if name.startswith("actorlm-submit")]
    finally:
        llm.shutdown()


def test_the_chat_template_is_compiled_before_the_first_request(tiny_llama_dir, tmp_path,
                                                                monkeypatch):
    import shutil

    import jinja2

    # a template of its own: transformers caches compiled templates, and other tests have
    # compiled the checkpoint's
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    template = model / "chat_template.jinja"
    template.write_text(template.read_text() + "{# this test's own #}")
    llm = AsyncLLM(str(model), dtype="float32", num_kv_blocks=64)
    try:
        compiled = []
        real = jinja2.Environment.from_string

        def counting(env, source, *args, **kwargs):
            compiled.append(source)
            return real(env, source, *args, **kwargs)

        monkeypatch.setattr(jinja2.Environment, "from_string", counting)
        conversation = [{"role": "user", "content": "What is two plus two?"}]
        ids = asyncio.run(llm.run_blocking(llm.apply_chat_template, conversation))
        assert compiled == []
        assert ids == llm.tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    finally:
        llm.shutdown()
