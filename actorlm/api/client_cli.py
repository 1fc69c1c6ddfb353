"""``actorlm chat`` and ``actorlm complete`` (vLLM's ``vllm chat`` / ``vllm complete``): the
official ``openai`` client against a running server, answers streamed to the terminal. With
``-q MESSAGE`` one exchange and out; else a prompt loop until end of input. The model is the
server's first unless ``--model-name`` names one; the key is ``--api-key``, else
``OPENAI_API_KEY``, else none needed."""

from __future__ import annotations

import os
import sys


def add_client_commands(commands) -> None:
    chat = commands.add_parser("chat", help="chat with a running server's model")
    _add_connection_flags(chat)
    chat.add_argument("--system-prompt", default=None, help="the conversation's system message")
    chat.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                      help="send MESSAGE, print the answer and exit")
    chat.set_defaults(run=_chat, log_level="WARNING")  # (answers, not the requests' log)
    complete = commands.add_parser("complete", help="complete prompts with a running server")
    _add_connection_flags(complete)
    complete.add_argument("--max-tokens", type=int, default=None,
                          help="the most tokens an answer may have")
    complete.add_argument("-q", "--quick", default=None, metavar="PROMPT",
                          help="complete PROMPT, print the completion and exit")
    complete.set_defaults(run=_complete, log_level="WARNING")


def _add_connection_flags(parser) -> None:
    parser.add_argument("--url", default="http://localhost:8000/v1",
                        help="the server's OpenAI API (default: http://localhost:8000/v1)")
    parser.add_argument("--model-name", default=None,
                        help="the model to ask (default: the server's first)")
    parser.add_argument("--api-key", default=None,
                        help="the server's API key (default: $OPENAI_API_KEY)")


def _connect(args):
    """(client, model name)."""
    import openai

    client = openai.OpenAI(base_url=args.url,
                           api_key=args.api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"))
    try:
        model = args.model_name or client.models.list().data[0].id
    except openai.APIConnectionError:
        raise ValueError(f"no server answers at {args.url} (start one with actorlm serve)") \
            from None
    return client, model


def _chat(args) -> int:
    client, model = _connect(args)
    conversation = [] if args.system_prompt is None else \
        [{"role": "system", "content": args.system_prompt}]
    for message in _messages(args.quick, "Please enter a message for the chat model:"):
        conversation.append({"role": "user", "content": message})
        stream = client.chat.completions.create(model=model, messages=conversation,
                                                stream=True)
        answer = _printed(c.choices[0].delta.content or "" for c in stream if c.choices)
        conversation.append({"role": "assistant", "content": answer})
    return 0


def _complete(args) -> int:
    client, model = _connect(args)
    for prompt in _messages(args.quick, "Please enter prompt to complete:"):
        stream = client.completions.create(model=model, prompt=prompt, stream=True,
                                           max_tokens=args.max_tokens)
        _printed(c.choices[0].text for c in stream if c.choices)
    return 0


def _messages(quick: str | None, invitation: str):
    """The one ``-q`` message, or the lines typed until end of input."""
    if quick is not None:
        yield quick
        return
    print(invitation)
    while True:
        try:
            yield input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return


def _printed(pieces) -> str:
    """The pieces written out as they come; returns their text."""
    text = []
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
        text.append(piece)
    print()
    return "".join(text)
