"""The workers as processes (``--distributed-executor-backend mp``) and as Ray actors (``ray``):
the same greedy tokens as in-process workers; a worker killed mid-run (``kill -9``,
``ray.kill``) costs no request; a checkpoint that cannot load raises in the caller and leaves
no process behind; all of it with one rank and with the model sharded over two
(``tensor_parallel_size=2``, gloo)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time

import psutil
import pytest

from actorlm import SamplingParams
from actorlm.llm import LLM
from engine_helpers import PROMPTS, full_length_tokens, live_children, undisturbed_tokens

TENSOR_PARALLEL_SIZES = [1, 2]
FLAGS = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 512, "max_model_len": 512}
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_llama_long_dir):
    """The in-process workers' greedy tokens."""
    return undisturbed_tokens(tiny_llama_long_dir, PROMPTS, GREEDY, **FLAGS)



def kill_mid_run(llm, kill) -> tuple[list[list[int]], float]:
    """Generate ``PROMPTS`` while ``kill()`` strikes a worker once several requests are
    decoding; returns the tokens and how long the engine took to see the death."""
    outputs: list = []
    run = threading.Thread(target=lambda: outputs.extend(
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)))
    run.start()
    while llm.engine.scheduler_stats().num_steps < 10:
        time.sleep(0.005)
    kill()
    killed_at = time.monotonic()
    while llm.engine.executor_stats().num_worker_restarts == 0:
        assert time.monotonic() - killed_at < 10, "the worker's death was not seen"
        time.sleep(0.005)
    seen_after = time.monotonic() - killed_at
    assert run.is_alive(), "the run ended before the kill: make it longer"
    run.join(timeout=120)
    assert not run.is_alive()
    return full_length_tokens(outputs), seen_after


@pytest.mark.parametrize("tp", TENSOR_PARALLEL_SIZES)
def test_worker_processes_give_the_same_greedy_tokens(tiny_llama_long_dir, expected, make_llm,
                                                      tp):
    llm = make_llm(str(tiny_llama_long_dir), distributed_executor_backend="mp",
                   tensor_parallel_size=tp, **FLAGS)
    pids = llm.engine.worker_pids()
    assert len(pids) == tp and os.getpid() not in pids
    assert full_length_tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected


@pytest.mark.parametrize("tp", TENSOR_PARALLEL_SIZES)
def test_a_worker_process_killed_mid_run_costs_no_request(tiny_llama_long_dir, expected,
                                                          make_llm, tp):
    llm = make_llm(str(tiny_llama_long_dir), distributed_executor_backend="mp",
                   tensor_parallel_size=tp, **FLAGS)
    pid = llm.engine.worker_pids()[0]
    got, seen_after = kill_mid_run(llm, lambda: os.kill(pid, signal.SIGKILL))
    assert seen_after < 2.0
    assert got == expected
    stats = llm.stats()
    assert stats["num_worker_restarts"] == 1 and stats["num_preemptions"] >= len(PROMPTS)
    assert pid not in llm.engine.worker_pids() and not psutil.pid_exists(pid)


def test_a_checkpoint_that_cannot_load_raises_in_the_caller_and_leaves_no_process(
        tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(Exception) as in_process:
        LLM(str(broken), dtype="float32")
    with pytest.raises(type(in_process.value)) as in_worker:
        LLM(str(broken), dtype="float32", distributed_executor_backend="mp")
    assert str(in_worker.value) == str(in_process.value)
    assert live_children("process_main", "actorlm::worker-") == []


@pytest.mark.parametrize("tp", TENSOR_PARALLEL_SIZES)
def test_ray_workers_give_the_same_greedy_tokens_and_survive_ray_kill(
        tiny_llama_long_dir, expected, make_llm, ray_cluster, tp):
    llm = make_llm(str(tiny_llama_long_dir), distributed_executor_backend="ray",
                   tensor_parallel_size=tp, **FLAGS)
    assert full_length_tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    actor = llm.engine.executor.proxy().group.get().actors[0]
    got, seen_after = kill_mid_run(llm, lambda: ray_cluster.kill(actor))
    assert got == expected
    assert llm.stats()["num_worker_restarts"] == 1 and seen_after < 5.0


@pytest.mark.parametrize("tp", TENSOR_PARALLEL_SIZES)
def test_constrained_steps_take_their_bitmask_across_to_the_worker(tiny_llama_dir, make_llm,
                                                                    tp):
    from actorlm.sampling_params import StructuredOutputsParams

    llm = make_llm(str(tiny_llama_dir), distributed_executor_backend="mp",
                   tensor_parallel_size=tp)
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                             structured_outputs=StructuredOutputsParams(regex=pattern))
              for i in range(4)] + [SamplingParams(max_tokens=8, temperature=0.0)]
    outputs = llm.generate(["Answer:"] * 5, params, use_tqdm=False)
    assert all(re.fullmatch(pattern, o.outputs[0].text) for o in outputs[:4])
    assert len(outputs[4].outputs[0].token_ids) == 8  # its unconstrained neighbour


def test_a_ray_worker_killed_between_steps_is_seen_at_once(tiny_llama_dir, make_llm,
                                                           ray_cluster):
    llm = make_llm(str(tiny_llama_dir), distributed_executor_backend="ray")
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ray_cluster.kill(llm.engine.executor.proxy().group.get().actors[0])
    killed_at = time.monotonic()
    while llm.engine.executor_stats().num_worker_restarts == 0:
        assert time.monotonic() - killed_at < 5, "the idle worker's death was not seen"
        time.sleep(0.01)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert full_length_tokens(again) == full_length_tokens(first)
