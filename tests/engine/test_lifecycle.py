"""The engine behaves like a library: scripts that never call shutdown() exit, a forgotten LLM is
collected with its actors, and a dead engine actor makes generate() raise, never hang."""

import gc
import subprocess
import sys
import textwrap
import threading
import time

import pykka
import pytest

from actorlm import EngineDeadError, SamplingParams
from actorlm.engine_actor import EngineActor
from actorlm.llm import LLM

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
FLAGS = 'dtype="float32", num_kv_blocks=64'

SCRIPTS = {
    # as vLLM's quick-start has it: no shutdown(), no context manager
    "LLM": f"""
        from actorlm import LLM, SamplingParams
        llm = LLM(MODEL, {FLAGS})
        print(llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].text)
    """,
    # a request still running when the script ends
    "LLM-busy": f"""
        import threading
        from actorlm import LLM, SamplingParams
        llm = LLM(MODEL, {FLAGS})
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        threading.Thread(target=llm.generate, args=(["Hello"], params), daemon=True).start()
        while not llm.stats()["num_running"]:
            pass
    """,
    "AsyncLLM": f"""
        import asyncio
        from actorlm import AsyncLLM, SamplingParams
        engine = AsyncLLM(MODEL, {FLAGS})
        async def main():
            async for output in engine.generate("Hello", SamplingParams(max_tokens=4)):
                pass
            print(output.outputs[0].text)
        asyncio.run(main())
    """,
}


def _time_to_exit(argv: list[str]) -> float:
    """Seconds between the process printing its last line ("LAST") and exiting (rc 0)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("LAST"):
                last = time.monotonic()
                break
        else:
            pytest.fail(f"no LAST line; stderr:\n{proc.stderr.read()[-3000:]}")
        proc.wait(timeout=30)
        took = time.monotonic() - last
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
    return took


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_script_without_shutdown_exits_promptly(tiny_llama_dir, name):
    body = textwrap.dedent(SCRIPTS[name]) + 'print("LAST", flush=True)\n'
    code = f"MODEL = {str(tiny_llama_dir)!r}\n" + body
    assert _time_to_exit([sys.executable, "-c", code]) < 10


def test_actorlm_generate_exits_promptly(tiny_llama_dir):
    # the command's own output is its last line; a wrapper prints LAST right after it
    code = textwrap.dedent(f"""
        import sys
        from actorlm.api.cli import main
        rc = main(["generate", "--model", {str(tiny_llama_dir)!r}, "--dtype", "float32",
                   "--num-kv-blocks", "64", "--max-tokens", "4", "Hello"])
        print("LAST", flush=True)
        sys.exit(rc)
    """)
    assert _time_to_exit([sys.executable, "-c", code]) < 10


def _engine_actors() -> list:
    return [ref for ref in pykka.ActorRegistry.get_all()
            if issubclass(ref.actor_class, EngineActor)]


def test_a_forgotten_llm_is_collected_and_its_actors_stop(tiny_llama_dir):
    before = set(_engine_actors())
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    mine = [ref for ref in _engine_actors() if ref not in before]
    assert mine and all(threading_is_daemon(ref) for ref in mine)
    del llm
    gc.collect()
    assert not any(ref.is_alive() for ref in mine)


def threading_is_daemon(ref) -> bool:
    return ref.actor_class.use_daemon_thread


def test_a_dead_scheduler_makes_generate_raise_within_a_second(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    try:
        outcome = {}

        def generate():
            try:
                llm.generate(["Once upon a time"], LONG, use_tqdm=False)
            except EngineDeadError as exc:
                outcome["error"], outcome["at"] = exc, time.monotonic()

        thread = threading.Thread(target=generate)
        thread.start()
        while not llm.stats()["num_running"]:
            time.sleep(0.005)
        killed_at = time.monotonic()
        llm.engine.scheduler.tell("a message no handler knows")  # the scheduler raises
        thread.join(5)
        assert not thread.is_alive(), "generate() still waits on a dead engine"
        assert outcome["at"] - killed_at < 1.0
        assert "scheduler" in str(outcome["error"]) and "TypeError" in str(outcome["error"])
        with pytest.raises(EngineDeadError, match="scheduler"):  # and at once from now on
            llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    assert not any(ref.is_alive() for ref in (llm.engine.frontend, llm.engine.executor,
                                               llm.engine.allocator))
