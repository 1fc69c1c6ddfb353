"""KV-cache groups: the model's layers grouped by what their attention can still read.

A full-attention layer reads every earlier position; a sliding-window layer of window W only
the last W. Layers of one kind share a block table, so the allocator can give a sliding
group's blocks back to the pool once they fall out of its window while the full group keeps
all of its own. As in vLLM's hybrid allocator, every group has the same number of layers
(``group_size``; the last group of a kind may have fewer): the KV cache is ``group_size``
pairs of tensors, and layer ``j`` of every group stores its blocks in pair ``j``. A block id
then means the same memory, one page in each of ``group_size`` layers, whichever group
holds it, and one pool serves them all.

A model whose layers are all of one kind has a single group of all its layers, and a
block table per request exactly as before.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class KVCacheGroup(NamedTuple):
    window: int | None  # positions each query reads (the newest W); None: all before it
    layers: tuple[int, ...]  # the model's layer indices, in order


def kv_cache_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """The groups of a model whose layer ``i`` attends over ``layer_windows[i]`` positions
    (None: full attention): full-attention groups first, then each window's, in the order of
    their first layer."""
    if not layer_windows:
        raise ValueError("a model has at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        if window is not None and window <= 0:
            raise ValueError(f"layer {layer}: a sliding window must be positive, got {window}")
        kinds.setdefault(window, []).append(layer)
    order = sorted(kinds, key=lambda w: (w is not None, kinds[w][0]))
    size = group_size(layer_windows)
    return [KVCacheGroup(window, tuple(kinds[window][i:i + size]))
            for window in order for i in range(0, len(kinds[window]), size)]


def group_size(layer_windows: Sequence[int | None]) -> int:
    """Layers per group: the fewest layers any kind has, so that no kind's last group is
    mostly empty KV tensors (with 15 sliding layers and 3 full ones: groups of 3)."""
    counts: dict[int | None, int] = {}
    for window in layer_windows:
        counts[window] = counts.get(window, 0) + 1
    return min(counts.values())


def layer_slots(groups: Sequence[KVCacheGroup]) -> tuple[list[int], list[int]]:
    """(group of each layer, KV tensor pair of each layer), indexed by layer."""
    num_layers = sum(len(g.layers) for g in groups)
    group_of, slot_of = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for slot, layer in enumerate(group.layers):
            group_of[layer], slot_of[layer] = g, slot
    return group_of, slot_of
