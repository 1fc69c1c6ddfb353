"""The engine core in a process of its own (``engine_core_process=True``): the same greedy
tokens as in this process; its queries answered across the boundary; a ``kill -9`` of the core
mid-run costs no request (each resumes in the restarted core as its prompt and the tokens it
had streamed, and gives the tokens of an undisturbed run, in fp32), and neither does a core
that hangs (its heartbeat stops); a model the core cannot load raises in the caller and leaves
no process behind."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time

import msgspec
import psutil
import pytest

from actorlm import SamplingParams
from actorlm.async_llm import AsyncLLM
from actorlm.llm import LLM
from engine_helpers import (PROMPTS, TOP, check_logprobs_close, engine_greedy,
                            full_length_tokens, live_children, undisturbed_tokens)
from processes import NEVER_LOADS

FLAGS = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 1024, "max_model_len": 512}
GREEDY = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_llama_long_dir):
    return undisturbed_tokens(tiny_llama_long_dir, PROMPTS, GREEDY, **FLAGS)


def test_the_core_in_its_own_process_gives_the_same_greedy_tokens(tiny_llama_long_dir,
                                                                 expected, make_llm):
    llm = make_llm(str(tiny_llama_long_dir), engine_core_process=True, **FLAGS)
    pid = llm.engine.core_pid
    assert pid != os.getpid() and psutil.Process(pid).cmdline()[0] == "actorlm::engine-core"
    assert full_length_tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    stats = llm.stats()  # asked across the boundary
    assert stats["num_finished"] == len(PROMPTS) and stats["num_engine_core_restarts"] == 0
    assert llm.engine.reset_prefix_cache() is True


def kill_the_core_under_streams(model_dir, flags, params):
    """16 streams through an AsyncLLM whose core is killed (``kill -9``) once every stream
    has 8 tokens: (their outputs, the stats after, the killed and the restarted pids)."""
    prompts = PROMPTS * 4

    async def run():
        engine = AsyncLLM(str(model_dir), engine_core_process=True, **flags)
        try:
            pid = engine.engine.core_pid
            seen: dict[str, int] = {}

            async def stream(i):
                final = None
                async for output in engine.generate(prompts[i], params, request_id=f"s{i}"):
                    seen[f"s{i}"] = len(output.outputs[0].token_ids)
                    final = output
                return final

            tasks = [asyncio.create_task(stream(i)) for i in range(len(prompts))]
            while len(seen) < len(prompts) or min(seen.values()) < 8:
                await asyncio.sleep(0.002)
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            assert max(seen.values()) < params.max_tokens, "the run ended before the kill"
            while engine.engine.num_core_restarts == 0 or engine.check_health() is not None:
                assert time.monotonic() - killed_at < 5.0, "not serving again within 5 s"
                await asyncio.sleep(0.01)
            outputs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            stats = await engine.get_stats()
            return outputs, stats, pid, engine.engine.core_pid
        finally:
            await asyncio.to_thread(engine.shutdown)

    outputs, stats, killed, restarted = asyncio.run(run())
    assert all(o.error is None for o in outputs)
    assert stats["num_engine_core_restarts"] == 1 and restarted != killed
    assert not psutil.pid_exists(killed) or psutil.Process(killed).status() == psutil.STATUS_ZOMBIE
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return outputs


def test_a_core_killed_mid_run_is_restarted_and_every_stream_finishes_with_its_tokens(
        tiny_llama_long_dir, expected):
    outputs = kill_the_core_under_streams(tiny_llama_long_dir, FLAGS, GREEDY)
    assert full_length_tokens(outputs) == expected * 4


def test_in_bf16_the_resumed_streams_stay_within_check_logprobs_close(tiny_llama_long_dir):
    """bf16: a recomputed prefix rounds differently from the decode that made it, so a
    stream may part from the undisturbed run at a near-tie, never elsewhere."""
    flags = {**FLAGS, "dtype": "bfloat16"}
    params = msgspec.structs.replace(GREEDY, logprobs=TOP)
    with LLM(str(tiny_llama_long_dir), **flags) as llm:
        undisturbed = llm.generate(PROMPTS * 4, params, use_tqdm=False)
    resumed = kill_the_core_under_streams(tiny_llama_long_dir, flags, params)
    full_length_tokens(resumed)
    check_logprobs_close(engine_greedy(resumed), engine_greedy(undisturbed))


def test_a_core_that_hangs_is_killed_restarted_and_its_requests_resumed(
        tiny_llama_long_dir, expected, make_llm, monkeypatch):
    from actorlm.engine_core import client

    monkeypatch.setattr(client, "HANG_S", 2.0)  # (30 s by default)
    llm = make_llm(str(tiny_llama_long_dir), engine_core_process=True, **FLAGS)
    pid = llm.engine.core_pid
    outputs: list = []
    run = threading.Thread(target=lambda: outputs.extend(
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)))
    run.start()
    while llm.engine.scheduler_stats().num_steps < 10:
        time.sleep(0.005)
    os.kill(pid, signal.SIGSTOP)  # alive, and silent
    run.join(timeout=120)
    assert not run.is_alive()
    assert full_length_tokens(outputs) == expected
    assert llm.stats()["num_engine_core_restarts"] == 1 and llm.engine.core_pid != pid


def test_a_step_stuck_in_a_worker_is_a_hang_the_core_is_restarted_and_requests_resumed(
        tiny_llama_long_dir, expected, make_llm, monkeypatch):
    """The worker (a process of its own) stops mid-step, as a kernel that never returns: the
    core's scheduler still answers its heartbeat, which says how long the step has run, and
    past the deadline the frontend kills the core and resumes its requests."""
    from actorlm.engine_core import client

    monkeypatch.setattr(client, "STEP_HANG_S", 2.0)  # (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)
    monkeypatch.setattr(client, "HANG_S", 60.0)  # not a silent core
    llm = make_llm(str(tiny_llama_long_dir), engine_core_process=True,
                   distributed_executor_backend="mp", **FLAGS)
    core = llm.engine.core_pid
    (worker,) = llm.engine.executor_stats().worker_pids
    outputs: list = []
    run = threading.Thread(target=lambda: outputs.extend(
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)))
    run.start()
    try:
        while llm.engine.scheduler_stats().num_steps < 10:
            time.sleep(0.005)
        os.kill(worker, signal.SIGSTOP)  # alive, and never answering its step
        run.join(timeout=120)
    finally:
        os.kill(worker, signal.SIGKILL)  # (stopped, it cannot see its parent go)
    assert not run.is_alive()
    assert full_length_tokens(outputs) == expected
    assert llm.stats()["num_engine_core_restarts"] == 1 and llm.engine.core_pid != core
    assert llm.engine.scheduler_stats().step_running_s < 2.0


def test_a_model_the_core_cannot_load_raises_in_the_caller_and_leaves_no_process(
        tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(Exception) as in_process:
        LLM(str(broken), dtype="float32")
    with pytest.raises(type(in_process.value)) as in_core:
        LLM(str(broken), dtype="float32", engine_core_process=True)
    assert str(in_core.value) == str(in_process.value)
    assert live_children("engine_core", "actorlm::engine-core") == []


def test_a_load_cancelled_while_the_core_loads_kills_the_core_and_raises(tiny_llama_dir,
                                                                         monkeypatch):
    from actorlm.engine_core import client

    monkeypatch.setattr(client, "_BOOT", NEVER_LOADS)
    cancel, raised = threading.Event(), []

    def build():
        try:
            AsyncLLM(str(tiny_llama_dir), engine_core_process=True, cancel_load=cancel, **FLAGS)
        except BaseException as exc:  # noqa: BLE001 — what the test reads
            raised.append(exc)

    loading = threading.Thread(target=build)
    loading.start()
    deadline = time.monotonic() + 30
    while not live_children("engine_core", "actorlm::engine-core"):
        assert loading.is_alive() and time.monotonic() < deadline, raised
        time.sleep(0.05)
    cancel.set()
    loading.join(5)
    assert not loading.is_alive() and isinstance(raised[0], client.LoadCancelled)
    assert "stopped while loading the model" in str(raised[0])
    assert live_children("engine_core", "actorlm::engine-core") == []


def test_a_core_exits_when_its_frontend_is_gone(tiny_llama_dir, tmp_path):
    """The core's watchdog: a frontend killed outright leaves no core running, and no
    directory of the sockets it had bound."""
    script = tmp_path / "frontend.py"
    script.write_text(
        "import os, sys, time\n"
        "from actorlm.llm import LLM\n"
        f"llm = LLM({str(tiny_llama_dir)!r}, dtype='float32', engine_core_process=True)\n"
        "print(llm.engine.core_pid, flush=True)\n"
        "time.sleep(600)\n")
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        core = psutil.Process(int(proc.stdout.readline()))
        assert core.is_running()
        sockets = {os.path.dirname(c.laddr) for c in psutil.Process(proc.pid).net_connections(
            kind="unix") if "actorlm-core-" in c.laddr}
        assert len(sockets) == 1 and os.path.isdir(*sockets)
    finally:
        proc.kill()
        proc.wait()
    core.wait(timeout=10)  # the watchdog polls every 0.5 s
    assert not core.is_running()
    assert not os.path.exists(*sockets)


def test_the_frontend_resumes_live_children_finishes_aborted_ones_and_narrows_the_blame(
        tiny_llama_dir):
    """``ResumeRequests``, against the frontend alone: an n = 2 request resumes as two
    requests of one child each, with their tokens and seeds; an aborted one is finished.
    At a second death the live ones resume as suspects (each runs alone for a step); a death
    while one of them runs alone fails that one only, and counts against no other; a request
    live at five deaths that no trial explained fails."""
    import queue

    from actorlm.actors.frontend import FrontendActor
    from actorlm.messages import (AbortRequests, EngineOutputs, RequestDelta, ResumeRequests,
                                  SubmitRequest, child_request_id)
    from actorlm.tokenizer import PerThreadTokenizer
    from transformers import AutoTokenizer

    class Scheduler:
        def tell(self, message):
            pass

    tokenizer = PerThreadTokenizer(AutoTokenizer.from_pretrained(tiny_llama_dir))
    frontend = FrontendActor.start(tokenizer, 512, 256, Scheduler())
    sinks = {rid: queue.Queue() for rid in ("pair", "gone", "bystander")}
    first, second = child_request_id("pair", 0), child_request_id("pair", 1)

    def resumed_ids():
        return {r.request_id: r.suspect for r in frontend.ask(ResumeRequests()).requests}

    try:
        frontend.ask(SubmitRequest("pair", [5, 6, 7], SamplingParams(n=2, seed=40,
                                                                      max_tokens=9), sinks["pair"]))
        frontend.ask(SubmitRequest("gone", [8, 9], SamplingParams(max_tokens=9), sinks["gone"]))
        frontend.ask(SubmitRequest("bystander", [4], SamplingParams(max_tokens=9),
                                   sinks["bystander"]))
        frontend.tell(EngineOutputs(0, [RequestDelta(first, [11, 12]),
                                        RequestDelta(second, [13]),
                                        RequestDelta("gone", [14])]))
        frontend.tell(AbortRequests(["gone"]))
        resumed = frontend.ask(ResumeRequests())  # a first death: no one is suspect yet
        second_death = resumed_ids()  # a second: the live ones run alone a step each
        frontend.tell(EngineOutputs(3, [], on_trial=["bystander"]))
        frontend.tell(EngineOutputs(3, [], trial_over=["bystander"]))  # it passed
        frontend.tell(EngineOutputs(4, [], on_trial=[first]))
        third_death = frontend.ask(ResumeRequests())  # in pair's trial: pair is the cause
        later = [resumed_ids() for _ in range(2)]  # (deaths that no trial explains)
        fifth = frontend.ask(ResumeRequests())  # bystander was live at five of them
    finally:
        frontend.stop()
    by_id = {r.request_id: r for r in resumed.requests}
    assert set(by_id) == {first, second, "bystander"}
    assert sorted(resumed.request_ids) == ["bystander", "gone", "pair"]
    assert not any(r.suspect for r in resumed.requests)
    assert by_id[first].output_token_ids == [11, 12] and by_id[second].output_token_ids == [13]
    assert by_id[first].sampling_params.n == by_id[second].sampling_params.n == 1
    assert by_id[second].seed == by_id[first].seed + 1 == 41
    assert by_id[first].prompt_token_ids == [5, 6, 7]
    final = sinks["gone"].get(timeout=5)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert final.outputs[0].token_ids == [14]
    assert second_death == {first: True, second: True, "bystander": True}
    assert [r.request_id for r in third_death.requests] == ["bystander"]
    failed = sinks["pair"].get(timeout=5)
    assert failed.finished and "ran alone" in failed.error
    assert later == [{"bystander": True}] * 2  # its count did not move at the third
    assert fifth.requests == [] and fifth.request_ids == ["bystander"]
    assert "died 5 times" in sinks["bystander"].get(timeout=5).error


