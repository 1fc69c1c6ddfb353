"""A message's content as its chat template reads it (vLLM's ``--chat-template-content-format``).

A client sends a message's content as a string or as OpenAI's list of parts
(``[{"type": "text", "text": ...}]``). Templates read one form or the other: Llama 3's, Qwen's
and SmolLM2's concatenate ``message['content']`` as a string; Gemma 3's, Mistral 3's and Llama
4's loop over its parts (and take a string too). So the conversation is handed over in the
template's form: ``string`` joins a message's text parts with newlines; ``openai`` gives every
content as a list of parts (a string as one part, none as no parts). ``auto`` picks ``openai``
for a template that loops over a message's content, directly or through a variable set from
it, and ``string`` otherwise, as vLLM decides.
"""

from __future__ import annotations

import functools

CONTENT_FORMATS = ("auto", "string", "openai")


def check_content_format(value: str, name: str) -> None:
    if value not in CONTENT_FORMATS:
        raise ValueError(f"{name} must be one of {', '.join(CONTENT_FORMATS)}, got {value!r}")


def with_content_format(conversation: list[dict], content_format: str,
                        template: str | dict | None) -> list[dict]:
    """``conversation`` with each message's content in ``content_format`` (``auto``: the form
    ``template`` reads; a dict of named templates: ``openai`` if any of them loops)."""
    if content_format == "auto":
        templates = template.values() if isinstance(template, dict) else [template]
        content_format = "openai" if any(isinstance(t, str) and loops_over_content(t)
                                         for t in templates) else "string"
    return [_message(m, content_format) if isinstance(m, dict) else m for m in conversation]


def _message(message: dict, content_format: str) -> dict:
    content = message.get("content")
    if content_format == "string" and isinstance(content, list):
        texts = [part.get("text") or "" for part in content if isinstance(part, dict)]
        return {**message, "content": "\n".join(texts)}
    if content_format == "openai" and not isinstance(content, list):
        return {**message, "content": [{"type": "text", "text": content}] if content else []}
    return message


@functools.lru_cache(maxsize=16)
def loops_over_content(template: str) -> bool:
    """Whether ``template`` has a for loop over a message's ``content`` (an item or attribute
    named so), or over a variable set from one."""
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        tree = ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError:
        return False  # (rendering it will say what is wrong)

    content_names: set[str] = set()  # variables set from a message's content

    def reads_content(node) -> bool:
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        if isinstance(node, nodes.Getattr):
            return node.attr == "content"
        if isinstance(node, nodes.Filter):  # message['content'] | selectattr(...)
            return reads_content(node.node)
        return isinstance(node, nodes.Name) and node.name in content_names

    content_names.update(a.target.name for a in tree.find_all(nodes.Assign)
                         if isinstance(a.target, nodes.Name) and reads_content(a.node))
    return any(reads_content(loop.iter) for loop in tree.find_all(nodes.For))
