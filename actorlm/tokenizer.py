"""A model's tokenizer, and one per thread: the frontend detokenizes while the API side
encodes.

A Hugging Face fast tokenizer wraps one Rust object that is not safe to share between threads:
a call that changes its truncation or padding settings while another thread encodes raises
"Already borrowed". The engine uses its tokenizer from several threads (the frontend actor,
``AsyncLLM``'s submit thread, the server's event loop, ``LLM``'s caller), so each thread gets
a copy of its own, made on its first use (a deep copy takes ~0.15 s for SmolLM2's).
"""

from __future__ import annotations

import copy
import json
import pathlib
import threading

# a multimodal checkpoint's processor keeps the chat template here (its tokenizer may not)
_PROCESSOR_TEMPLATE = "chat_template.json"


def load_tokenizer(path, tokenizer_path=None, vocab_size: int | None = None):
    """The tokenizer of the model directory ``path`` (or of ``tokenizer_path``, where the
    caller names one: ``--tokenizer``), with the chat template its processor keeps where the
    tokenizer has none (a multimodal checkpoint's ``chat_template.json``, as vLLM reads it).
    A tokenizer with more tokens than the model's ``vocab_size`` is refused."""
    from transformers import AutoTokenizer

    path = tokenizer_path or path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        if tokenizer_path is None:
            raise
        raise ValueError(f"--tokenizer {str(tokenizer_path)!r}: no tokenizer there ({exc})") \
            from None
    if tokenizer_path is not None and vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"--tokenizer {str(tokenizer_path)!r} has {len(tokenizer)} tokens, "
                         f"more than the model's vocabulary ({vocab_size})")
    template = pathlib.Path(path) / _PROCESSOR_TEMPLATE
    if getattr(tokenizer, "chat_template", None) is None and template.is_file():
        tokenizer.chat_template = json.loads(template.read_text())["chat_template"]
    return tokenizer


class PerThreadTokenizer:
    """Stands in for a tokenizer: every attribute is read from the calling thread's copy."""

    def __init__(self, tokenizer):
        self._original = tokenizer  # only ever copied, never called
        self._local = threading.local()
        self._copy_lock = threading.Lock()

    @property
    def for_this_thread(self):
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            with self._copy_lock:
                tokenizer = copy.deepcopy(self._original)
            self._local.tokenizer = tokenizer
        return tokenizer

    def __getattr__(self, name: str):
        return getattr(self.for_this_thread, name)

    def __len__(self) -> int:
        return len(self.for_this_thread)

    def __call__(self, *args, **kwargs):
        return self.for_this_thread(*args, **kwargs)

    def __repr__(self) -> str:
        return f"PerThreadTokenizer({self._original!r})"
