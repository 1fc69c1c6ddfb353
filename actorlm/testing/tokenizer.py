"""ToyTokenizer: a tokenizer stand-in for engines that run a FakeModelRunner.

Token ``i`` is the text piece ``" t<i>"``, so decoding is plain concatenation (the text of a
sequence is the sum of its tokens' texts, which keeps incremental detokenization and stop
strings trivially predictable) and ``encode(decode(ids)) == ids``. Other words are hashed to an
id so that any text prompt is accepted.
"""

from __future__ import annotations

import re
import zlib
from typing import Iterable

_PIECE = re.compile(r"t(\d+)")


class ToyTokenizer:
    def __init__(self, vocab_size: int = 1000, eos_token_id: int | None = None,
                 special_token_ids: Iterable[int] = ()):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.all_special_ids = sorted(set(special_token_ids) |
                                      ({eos_token_id} if eos_token_id is not None else set()))
        self.bos_token_id = None
        self.pad_token_id = None

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for word in text.split():
            match = _PIECE.fullmatch(word)
            if match and int(match.group(1)) < self.vocab_size:
                ids.append(int(match.group(1)))
            else:
                ids.append(zlib.crc32(word.encode()) % self.vocab_size)
        return ids

    def __call__(self, text: str, add_special_tokens: bool = True, **_) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return f"\u2581t{ids}"
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [f"\u2581t{i}" for i in ids if i not in special]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(token.replace("\u2581", " ") for token in tokens)

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = False, **_) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return "".join(f" t{i}" for i in token_ids if i not in special)

    def batch_decode(self, sequences, skip_special_tokens: bool = False, **kwargs) -> list[str]:
        return [self.decode(s, skip_special_tokens, **kwargs) for s in sequences]
