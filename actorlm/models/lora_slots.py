"""LoRA adapters on a model: a table of ``max_loras`` slots in each adapted layer, the adapters
that sit in them, and the step's token-to-slot mapping.

Each adapted layer (every decoder layer's ``qkv_proj``, ``o_proj`` and, in a dense MLP,
``gate_up_proj`` or an ungated one's ``fc_in``, and ``down_proj``) holds a
``kernels.lora.LoRATable``: ``a`` [max_loras, rank, in] and ``b`` [max_loras, rank, out]
(B transposed), zero where a slot's adapter is smaller or absent, with rank ``max_lora_rank``
times the parts it merges (q, k, v: three), each part's share of the rank at its own output
rows. All of them read one ``LoRAState``, whose
``mapping`` the runner sets before each forward: a layer adds its slots' deltas to the rows of
their tokens through the backend's door (``KernelBackend.add_lora``), and with no adapter in
the step it adds nothing and costs nothing. The tables also go into the layers' plans, so a
CPU's one-call decode step applies the same deltas (``CausalLM.build_decode_step``).

``LoRASlots`` decides which adapter sits where. The scheduler never puts more than
``max_loras`` distinct adapters in a step, so a step's adapters always fit; an adapter not in a
slot takes a free one or the one least recently used by a step, and is read from its directory
unless one of the ``max_cpu_loras`` adapters kept read in memory (least recently used beyond)
is it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Sequence

import torch

from actorlm.kernels.lora import LoRAMapping, LoRATable
from actorlm.lora_request import LoRARequest
from actorlm.models.families import layer_specs
from actorlm.models.lora_adapter import LoRAAdapter, load_lora_adapter
from actorlm.models.parallel import first_kv_head

_ADAPTED = {"self_attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "fc_in", "down_proj")}


class LoRAState:
    """The step's token groups by slot, shared by every adapted layer of the model."""

    def __init__(self):
        self.mapping = LoRAMapping([])


class LoRAShard(NamedTuple):
    """Where a layer's slots sit in an adapter's whole (merged) module: part p's rows of B
    start at ``part_rows[p]`` (this rank's share of the part's rows, under tensor
    parallelism: a column-parallel layer's B is split by its output rows), and A's columns
    ``in_cols`` (first, count) are this rank's (a row-parallel layer's A is split by its
    input columns, the partial deltas summed by the layer's all-reduce)."""

    part_rows: tuple[int, ...]
    in_cols: tuple[int, int]


class LoRAWeights:
    """One layer's slot table; ``add`` puts the step's deltas on its output. ``out_parts``:
    the output rows of each part it merges, whose adapters each get ``max_lora_rank`` of the
    rank; ``shard``: which rows and columns of an adapter's module it holds."""

    def __init__(self, state: LoRAState, backend, max_loras: int, max_lora_rank: int,
                 in_features: int, out_parts: tuple[int, ...], shard: LoRAShard, dtype,
                 device):
        self.state, self.backend, self.shard = state, backend, shard
        self.max_lora_rank, rank = max_lora_rank, max_lora_rank * len(out_parts)
        self.table = LoRATable(
            torch.zeros(max_loras, rank, in_features, dtype=dtype, device=device),
            torch.zeros(max_loras, rank, sum(out_parts), dtype=dtype, device=device),
            tuple(out_parts))

    def load(self, slot: int, module) -> None:
        """Slot ``slot`` to hold ``module`` (a ``LoRAModule``), or nothing. Each part's rank
        goes to its own share of the table's, so B stays block-diagonal by parts."""
        a, b, out_parts = self.table
        a[slot].zero_()
        b[slot].zero_()
        if module is None:
            return
        (first_col, num_cols), first_row = self.shard.in_cols, 0
        for part, (rows, rank) in enumerate(zip(out_parts, module.part_ranks, strict=True)):
            src, dst = sum(module.part_ranks[:part]), part * self.max_lora_rank
            src_row = self.shard.part_rows[part]
            a[slot, dst:dst + rank] = \
                module.a[src:src + rank, first_col:first_col + num_cols].to(a.dtype)
            b[slot, dst:dst + rank, first_row:first_row + rows] = \
                module.b[src_row:src_row + rows, src:src + rank].T.to(b.dtype)
            first_row += rows

    def add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        mapping = self.state.mapping
        if not mapping.groups:
            return y
        return self.backend.add_lora(y, x, self.table, mapping)


def adapted_layers(model, specs):
    """(layer index, engine layer name, the Linear, its parts' output rows, its
    ``LoRAShard``) of every layer an adapter may change (this rank's share of each, under
    tensor parallelism); ``specs``: the model's layers' (``families.layer_specs``)."""
    tp = model.tp
    for i, layer in enumerate(model.model.layers):
        spec = specs[i]
        for block_name, names in _ADAPTED.items():
            block = getattr(layer, block_name, None)
            for name in names:
                linear = getattr(block, name, None)
                if linear is None:  # (a mixture of experts has neither)
                    continue
                # whole parts' rows, and this rank's first of each (the checkpoint's split)
                if name == "qkv_proj":
                    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
                    kv0 = first_kv_head(tp, spec.num_heads, spec.num_kv_heads) * spec.head_dim
                    parts = (block.q_size, block.kv_size, block.kv_size)
                    part_rows = (tp.rank * block.q_size, q + kv0, q + kv + kv0)
                elif name == "gate_up_proj":
                    half = linear.out_features // 2
                    parts = (half, half)
                    part_rows = (tp.rank * half, spec.intermediate_size + tp.rank * half)
                elif name == "fc_in":  # column-parallel, one part
                    parts, part_rows = (linear.out_features,), (tp.rank * linear.out_features,)
                else:  # row-parallel: all of the outputs, this rank's inputs
                    parts, part_rows = (linear.out_features,), (0,)
                in_cols = (tp.rank * linear.in_features, linear.in_features) \
                    if name in ("o_proj", "down_proj") else (0, linear.in_features)
                yield i, name, linear, parts, LoRAShard(part_rows, in_cols)


class LoRASlots:
    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None):
        self.model, self.max_loras, self.max_lora_rank = model, max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.specs = layer_specs(model.config)
        self.state = LoRAState()
        self.layers: dict[tuple[int, str], LoRAWeights] = {}
        for i, name, linear, out_parts, shard in adapted_layers(model, self.specs):
            linear.lora = self.layers[(i, name)] = LoRAWeights(
                self.state, model.backend, max_loras, max_lora_rank, linear.in_features,
                out_parts, shard, model.dtype, model.device)
        model.lora_state = self.state
        model.build_decode_step()  # its plans now name the slots
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first
        self.read: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU first

    def set_mapping(self, loras: Sequence[LoRARequest | None], num_tokens: Sequence[int]
                    ) -> None:
        """The step's requests' adapters (None: the base model), each for its tokens, in
        order: their adapters placed in slots, and the layers told which rows are whose."""
        slots = {}
        for lora in loras:
            if lora is not None and lora.lora_int_id not in slots:
                slots[lora.lora_int_id] = self._place(lora, slots)
        token_slots = []
        for lora, n in zip(loras, num_tokens):
            token_slots += [-1 if lora is None else slots[lora.lora_int_id]] * n
        self.state.mapping = LoRAMapping.build(token_slots, self.model.device)

    def _place(self, lora: LoRARequest, in_step: dict[int, int]) -> int:
        """The slot of ``lora``, loading it there if it is in none."""
        lora_id = lora.lora_int_id
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)
            return self.slot_of[lora_id]
        taken = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:  # the least recently used slot whose adapter this step does not run
            victim = next((i for i in self.slot_of if i not in in_step), None)
            if victim is None:
                raise RuntimeError(f"a step with more than {self.max_loras} LoRA adapters "
                                   f"(the scheduler should never make one)")
            slot = self.slot_of.pop(victim)
        adapter = self._read(lora)
        for key, weights in self.layers.items():
            weights.load(slot, adapter.modules.get(key))
        self.slot_of[lora_id] = slot
        return slot

    def _read(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = self.read.pop(lora.lora_int_id, None)
        if adapter is None or str(adapter.path) != str(lora.lora_path):
            adapter = load_lora_adapter(lora.lora_name, lora.lora_path, self.specs,
                                        self.max_lora_rank)
        self.read[lora.lora_int_id] = adapter
        while len(self.read) > self.max_cpu_loras:
            self.read.popitem(last=False)
        return adapter
