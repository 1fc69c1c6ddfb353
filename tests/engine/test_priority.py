"""``scheduling_policy="priority"`` through the engine: waiting requests start in priority order
(smaller first, arrival among equals), in this process and across the engine-core process (the
priority crosses its wire); a priority under first come, first served is refused by name."""

from __future__ import annotations

import asyncio

import pytest

from actorlm import SamplingParams
from actorlm.async_llm import AsyncLLM

FLAGS = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 1024, "max_model_len": 512,
         "max_num_seqs": 1, "scheduling_policy": "priority"}
QUEUED = (("low", 7), ("high", -3), ("mid", 2), ("high-later", -3))


def start_order(model_dir, **flags) -> list[str]:
    """The order requests first stream a token in, one at a time (``max_num_seqs`` 1): one
    long request, then four queued behind it while it runs."""
    async def run():
        engine = AsyncLLM(str(model_dir), **FLAGS, **flags)
        try:
            order: list[str] = []

            async def stream(name: str, priority: int, max_tokens: int):
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                async for output in engine.generate("Once upon a time", params, request_id=name,
                                                    priority=priority):
                    if name not in order:
                        order.append(name)
                return output

            first = asyncio.create_task(stream("first", 0, 200))
            while not order:  # it runs: the others queue behind it
                await asyncio.sleep(0.001)
            queued = [asyncio.create_task(stream(name, p, 4)) for name, p in QUEUED]
            outputs = await asyncio.wait_for(asyncio.gather(first, *queued), 120)
            assert all(o.finished and o.error is None for o in outputs)
            return order
        finally:
            await asyncio.to_thread(engine.shutdown)

    return asyncio.run(run())


@pytest.mark.parametrize("engine_core_process", [False, True])
def test_queued_requests_start_in_priority_order(tiny_llama_long_dir, engine_core_process):
    order = start_order(tiny_llama_long_dir, engine_core_process=engine_core_process)
    assert order == ["first", "high", "high-later", "mid", "low"]


def test_a_priority_needs_the_priority_policy_and_one_per_prompt(tiny_llama_dir, make_llm):
    llm = make_llm(str(tiny_llama_dir))
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="priority: 1 needs --scheduling-policy priority"):
        llm.generate(["a", "b"], params, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate(["a", "b"], params, use_tqdm=False, priority=[0])
    assert len(llm.generate(["a", "b"], params, use_tqdm=False, priority=[0, 0])) == 2
    ranked = make_llm(str(tiny_llama_dir), scheduling_policy="priority")
    for bad in (True, 1.5, 2**63):
        with pytest.raises(ValueError, match="priority: must be a 64-bit integer"):
            ranked.generate(["a"], params, use_tqdm=False, priority=[bad])


def test_an_unknown_policy_is_refused_by_its_flag():
    from actorlm.config import EngineConfig

    with pytest.raises(ValueError, match="--scheduling-policy must be one of fcfs, priority"):
        EngineConfig(scheduling_policy="sjf")
