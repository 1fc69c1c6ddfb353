"""Data parallelism (``data_parallel_size=2``): two engine cores, each with its own KV pool,
behind one frontend. Greedy output is DP=1's, the requests are spread over both (read from
/metrics' ``engine`` label), each replica keeps to its share of the CPUs, and a ``kill -9`` of
one replica costs no request while the other's streams run on as before. With Ray (the
``ray`` backend) the replicas are Ray actors, and the output is the same."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actorlm import SamplingParams
from actorlm.api.metrics import ServerMetrics
from actorlm.async_llm import AsyncLLM
from actorlm.llm import LLM
from engine_helpers import PROMPTS as BASE_PROMPTS
from engine_helpers import full_length_tokens, undisturbed_tokens

PROMPTS = BASE_PROMPTS * 4
FLAGS = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 1024, "max_model_len": 512}
GREEDY = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_llama_long_dir):
    return undisturbed_tokens(tiny_llama_long_dir, PROMPTS, GREEDY, **FLAGS)


def per_engine(metrics_text: str, name: str) -> dict[str, float]:
    """One metric's samples by their ``engine`` label."""
    return {sample.labels["engine"]: sample.value
            for family in text_string_to_metric_families(metrics_text)
            for sample in family.samples if sample.name == name}


async def stream_all(engine: AsyncLLM, on_output=None) -> list:
    async def one(i):
        final = None
        async for output in engine.generate(PROMPTS[i], GREEDY, request_id=f"s{i}"):
            if on_output is not None:
                on_output(f"s{i}", output)
            final = output
        return final

    return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(PROMPTS)))), 180)


def test_two_replicas_give_dp1s_tokens_and_share_the_requests(tiny_llama_long_dir, expected):
    async def run():
        engine = AsyncLLM(str(tiny_llama_long_dir), data_parallel_size=2, **FLAGS)
        try:
            outputs = await stream_all(engine)
            text = (await asyncio.to_thread(ServerMetrics("tiny", lambda: engine).render))
            titles = [psutil.Process(pid).cmdline()[0] for pid in engine.engine.core_pids]
            return outputs, text.decode(), titles
        finally:
            await asyncio.to_thread(engine.shutdown)

    outputs, metrics, titles = asyncio.run(run())
    assert full_length_tokens(outputs) == expected
    finished = per_engine(metrics, "actorlm:engine_requests_finished_total")
    assert set(finished) == {"0", "1"} and sum(finished.values()) == len(PROMPTS)
    assert min(finished.values()) >= len(PROMPTS) // 4, f"unbalanced: {finished}"
    assert per_engine(metrics, "vllm:num_requests_running") == {"0": 0.0, "1": 0.0}
    assert titles == ["actorlm::engine-core-0", "actorlm::engine-core-1"]


def test_each_replica_keeps_to_its_share_of_the_cpus(tiny_llama_dir, make_llm):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"one CPU here ({cpus}): the replicas share it, unpinned")
    llm = make_llm(str(tiny_llama_dir), data_parallel_size=2, dtype="float32")
    shares = [set(psutil.Process(pid).cpu_affinity()) for pid in llm.engine.core_pids]
    assert shares[0].isdisjoint(shares[1]) and shares[0] | shares[1] <= set(cpus)
    assert len(shares[0]) == len(shares[1]) == len(cpus) // 2


def test_a_replica_killed_mid_run_resumes_its_own_while_the_other_runs_on(
        tiny_llama_long_dir, expected):
    async def run():
        engine = AsyncLLM(str(tiny_llama_long_dir), data_parallel_size=2, **FLAGS)
        router = engine.engine.router
        arrivals: dict[str, list[float]] = {}
        seen: dict[str, int] = {}
        killed_at = []

        def on_output(request_id, output):
            arrivals.setdefault(request_id, []).append(time.monotonic())
            seen[request_id] = len(output.outputs[0].token_ids)

        async def kill_replica_1():
            # as soon as every stream has begun: the first ones run far ahead of the last
            while len(seen) < len(PROMPTS) or min(seen.values()) < 2:
                await asyncio.sleep(0.002)
            assert max(seen.values()) < GREEDY.max_tokens, "the run ended before the kill"
            owners = {rid: router.balancer.owner(rid) for rid in seen}
            os.kill(engine.engine.core_pids[1], signal.SIGKILL)
            killed_at.append(time.monotonic())
            return owners

        try:
            owners, outputs = await asyncio.gather(kill_replica_1(), stream_all(engine,
                                                                                 on_output))
            stats = await engine.get_stats()
            return outputs, stats, owners, arrivals, killed_at[0]
        finally:
            await asyncio.to_thread(engine.shutdown)

    outputs, stats, owners, arrivals, killed_at = asyncio.run(run())
    assert full_length_tokens(outputs) == expected
    assert stats["num_engine_core_restarts"] == 1
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert {0, 1} <= set(owners.values())

    def pause_after_kill(request_id) -> float:
        """The longest wait between two outputs of a request from the kill on."""
        times = [t for t in arrivals[request_id] if t >= killed_at]
        return max(b - a for a, b in zip([killed_at] + times, times))

    victims = [rid for rid, owner in owners.items() if owner == 1]
    survivors = [rid for rid, owner in owners.items() if owner == 0]
    restart = min(pause_after_kill(rid) for rid in victims)  # what the restart cost them
    assert restart > 1.0  # a fresh process loads the model
    assert max(pause_after_kill(rid) for rid in survivors) < restart / 4


@pytest.mark.slow
def test_ray_replicas_give_dp1s_tokens(tiny_llama_long_dir, expected, ray_cluster):
    with LLM(str(tiny_llama_long_dir), data_parallel_size=2, data_parallel_backend="ray",
             **FLAGS) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        finished = [stats["num_finished"] for stats in llm.engine.replica_stats()]
    assert full_length_tokens(outputs) == expected
    assert min(finished) >= len(PROMPTS) // 4 and sum(finished) == len(PROMPTS)
