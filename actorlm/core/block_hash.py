"""Content hashes of full KV blocks, chained so that equal hashes mean equal prefixes.

Block ``i`` of a request hashes its parent's hash (block ``i - 1``), its own ``block_size``
token ids and ``extra_keys`` (anything else that changes the KV those tokens produce: a LoRA
adapter, multimodal inputs, a tenant's cache salt). Two requests' block ``i`` hashes are equal
only if everything up to and including that block is — which is what lets a new request reuse
another's KV for its whole common prefix.

The hash is BLAKE2b cut to 63 bits: stable across processes and runs (Python's ``hash`` is
salted per process), fits msgpack's signed integers, and a collision among the few million
blocks a pool ever holds is out of reach (the birthday bound is ~3·10⁹).
"""

from __future__ import annotations

from hashlib import blake2b
from typing import Sequence

_MASK = (1 << 63) - 1


def hash_block(parent: int | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    payload = repr((parent, tuple(token_ids), extra_keys)).encode()
    return int.from_bytes(blake2b(payload, digest_size=8).digest(), "little") & _MASK


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple = ()) -> list[int]:
    """Append the hashes of the full blocks of ``token_ids`` that ``hashes`` lacks (each block
    is hashed once, as tokens arrive); returns ``hashes``."""
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
