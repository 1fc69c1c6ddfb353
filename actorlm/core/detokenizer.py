"""Incremental detokenization and stop strings, per output sequence. Pure; the frontend owns them.

Text is produced token by token by decoding a small sliding window: the new text is what the
window decodes to beyond what its older part decoded to. That is correct for tokenizers that
merge across tokens (a leading-space marker, byte-level pieces), and a window that ends in an
incomplete UTF-8 character ("\\ufffd") waits for the next token instead of emitting garbage.
The window starts inside the prompt so the first output token is spaced as in a full decode.
"""

from __future__ import annotations

_PROMPT_CONTEXT = 5  # prompt tokens that seed the window
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._window = list(self._context)
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completes (possibly empty)."""
        self._window.append(token_id)
        prefix = self._decode(self._window[self._prefix_offset:self._read_offset])
        full = self._decode(self._window[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # nothing visible yet, or half a character: wait for more tokens
        new_text = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._window)
        if self._prefix_offset > 64:  # keep the window small: drop what no decode needs
            del self._window[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self.text += new_text
        return new_text

    def decode_all(self, token_ids: list[int]) -> str:
        """The whole output at once, spaced as the incremental text would be."""
        return self._decode(self._context + token_ids)[len(self._decode(self._context)):]

    def _decode(self, token_ids: list[int]) -> str:
        kwargs = {"skip_special_tokens": self.skip_special_tokens}
        if not self.spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False
        return self.tokenizer.decode(token_ids, **kwargs)


def find_stop_string(text: str, num_new_chars: int, stops: list[str],
                     include_in_output: bool) -> tuple[str, int] | None:
    """vLLM's stop-string check after ``num_new_chars`` were appended to ``text``.

    Returns (the stop string, the length to truncate the text to) or None. Stops are tried in
    the order given; only the tail that could contain a new match is searched.
    """
    for stop in stops:
        index = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if index == -1:
            continue
        return stop, index + len(stop) if include_in_output else index
    return None
