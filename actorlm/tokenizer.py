"""One tokenizer per thread: the frontend detokenizes while the API side encodes.

A Hugging Face fast tokenizer wraps one Rust object that is not safe to share between threads:
a call that changes its truncation or padding settings while another thread encodes raises
"Already borrowed". The engine uses its tokenizer from several threads (the frontend actor,
``AsyncLLM``'s submit thread, the server's event loop, ``LLM``'s caller), so each thread gets
a copy of its own, made on its first use (a deep copy takes ~0.15 s for SmolLM2's).
"""

from __future__ import annotations

import copy
import threading


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
