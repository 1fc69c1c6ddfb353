"""``actorlm serve --tensor-parallel-size 2``: the model sharded over two worker processes
(gloo), driven by the official ``openai`` client like any server, and gone without a trace on
SIGTERM."""

from __future__ import annotations

import signal

import psutil
from api_helpers import SERVED_NAME, serving

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me about the baker."}]


def _texts(client) -> tuple[str, str, str, str]:
    """(completion, its stream, chat, its stream) for the greedy requests above."""
    greedy = {"model": SERVED_NAME, "max_tokens": 24, "temperature": 0.0}
    completion = client.completions.create(prompt=PROMPT, **greedy).choices[0].text
    streamed = "".join(c.choices[0].text for c in
                       client.completions.create(prompt=PROMPT, stream=True, **greedy)
                       if c.choices)
    chat = client.chat.completions.create(messages=MESSAGES, **greedy).choices[0].message.content
    chat_streamed = "".join(c.choices[0].delta.content or "" for c in
                            client.chat.completions.create(messages=MESSAGES, stream=True,
                                                           **greedy) if c.choices)
    return completion, streamed, chat, chat_streamed


def test_a_sharded_server_streams_what_one_rank_serves(tiny_llama_dir, client, tmp_path):
    import openai

    completion, streamed, chat, chat_streamed = _texts(client)  # the session's one-rank server
    assert completion and chat
    with serving(tiny_llama_dir, tmp_path / "server.log", "--tensor-parallel-size", "2",
                 "--num-kv-blocks", "256", "--served-model-name", SERVED_NAME) as (proc, base):
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if p.cmdline()[0].startswith("actorlm::worker-")]  # (named themselves)
        assert len(workers) == 2
        with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                           timeout=60) as sharded:
            assert _texts(sharded) == (completion, completion, chat, chat)
        assert streamed == completion and chat_streamed == chat
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"worker processes outlived the server: {alive}"
