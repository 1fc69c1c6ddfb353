"""A PEFT LoRA adapter directory, read and checked against the base model it is to run on.

PEFT saves ``adapter_config.json`` (rank ``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``, per-module ``rank_pattern`` / ``alpha_pattern``, ...) and
``adapter_model.safetensors``, whose ``...layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in]
and ``lora_B.weight`` [out, r] make the delta ``scale * B @ A @ x`` of transformers' module
``q_proj`` (scale ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA).

The engine's layers merge transformers' projections (``qkv_proj`` is q, k and v stacked;
``gate_up_proj`` is gate and up), so the adapter of a merged layer is the adapters of its
parts as one: their A matrices stacked (rank: the sum of theirs) and a block-diagonal B, each
part's B at its rows and its A's columns, the scale folded in. One shrink and one expand per
layer then apply them all, with no per-part bookkeeping in the kernels.

Anything the adapter asks for that the engine does not compute (DoRA, trained biases, modules
saved whole such as the LM head, embeddings, other modules) or that does not fit the base model
(a layer it lacks, shapes of another model, a rank over ``--max-lora-rank``) is a
``LoRAAdapterError`` naming it; nothing is half-loaded.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from actorlm.models.checkpoint_names import qkv_regrouped
from actorlm.models.decoder import LayerSpec
from actorlm.models.rope_layout import reordered
from actorlm.openmp import on_passing_thread

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# the engine's merged layers: (transformers' module, its rows' size) per part, in stacking order
_PARTS = {
    "qkv_proj": (("q_proj", lambda s: s.num_heads * s.head_dim),
                 ("k_proj", lambda s: s.num_kv_heads * s.head_dim),
                 ("v_proj", lambda s: s.num_kv_heads * s.head_dim)),
    "o_proj": (("o_proj", lambda s: s.hidden_size),),
    "gate_up_proj": (("gate_proj", lambda s: s.intermediate_size),
                     ("up_proj", lambda s: s.intermediate_size)),
    "fc_in": (("fc_in", lambda s: s.intermediate_size),),  # an ungated MLP's
    "down_proj": (("down_proj", lambda s: s.hidden_size),),
}
_INPUTS = {"qkv_proj": lambda s: s.hidden_size, "o_proj": lambda s: s.num_heads * s.head_dim,
           "gate_up_proj": lambda s: s.hidden_size, "fc_in": lambda s: s.hidden_size,
           "down_proj": lambda s: s.intermediate_size}
# the families' own names of these projections: OPT's attention output and MLP (fc1, fc2,
# directly under the layer), Phi-2's (dense, fc1, fc2), StarCoder2's and GPT-2's MLP (c_fc,
# c_proj; GPT-2's attention output is c_proj too), GPT-NeoX's (dense, dense_h_to_4h,
# dense_4h_to_h; Falcon's the same under self_attention), and q/k/v fused: GPT-2's c_attn
# (one A for the three, B's rows q, k, v), GPT-NeoX's and Falcon's query_key_value (B's rows
# in groups of their queries, key and value, as the checkpoint's)
_ALIASES = {"out_proj": "o_proj", "dense": "o_proj", "fc1": "fc_in", "c_fc": "fc_in",
            "fc2": "down_proj", "c_proj": "down_proj", "dense_h_to_4h": "fc_in",
            "dense_4h_to_h": "down_proj"}
_ATTENTION_ALIASES = {**_ALIASES, "c_proj": "o_proj"}
_FUSED_QKV = ("c_attn", "query_key_value")
_LAYER_OF = {hf: layer for layer, parts in _PARTS.items() for hf, _ in parts}
_KEY = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\."
                  r"(?:(self_attn|attn|attention|self_attention|mlp)\.)?(\w+)"
                  r"\.lora_([AB])\.weight$")


class LoRAAdapterError(ValueError):
    """The adapter directory is malformed or does not fit the base model: the message says
    which file, key or setting."""


@dataclass(frozen=True)
class LoRAModule:
    """One engine layer's delta ``x @ a.T @ b.T`` (its scale folded into ``b``): its parts'
    adapters in the layer's order (q, k, v; gate, up), ``part_ranks`` each one's rank (0 for
    a part the adapter leaves alone)."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    part_ranks: tuple[int, ...]

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: Path
    modules: dict[tuple[int, str], LoRAModule]  # (layer index, engine layer name) -> delta

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def load_lora_adapter(name: str, path: str | Path, specs: list[LayerSpec],
                      max_lora_rank: int) -> LoRAAdapter:
    """The adapter at ``path`` for a base model of decoder layers ``specs``, in fp32."""
    path = Path(path)
    config = _read_config(path)
    tensors = _read_weights(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[str, str] = {}  # our part's name -> the adapter's (PEFT's alpha_pattern's)
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise LoRAAdapterError(f"{path / WEIGHTS_FILE}: {key!r} is no LoRA weight of a "
                                   f"decoder layer's projection (only "
                                   f"{', '.join(_LAYER_OF)} take adapters here)")
        layer, block, name, side = int(match[1]), match[2], match[3], match[4]
        aliases = _ATTENTION_ALIASES if block in ("self_attn", "attn", "attention",
                                                  "self_attention") \
            else _ALIASES
        module = aliases.get(name, name)
        if module not in _LAYER_OF and module not in _FUSED_QKV:
            raise LoRAAdapterError(f"{path / WEIGHTS_FILE}: {key!r}: module {name!r} "
                                   f"takes no adapter here (only {', '.join(_LAYER_OF)} and "
                                   f"the families' names of them: {', '.join(_ALIASES)}, "
                                   f"{', '.join(_FUSED_QKV)})")
        if layer >= len(specs):
            raise LoRAAdapterError(f"{path / WEIGHTS_FILE}: {key!r}: the base model has "
                                   f"{len(specs)} layers")
        if module == "up_proj" and not specs[layer].gated_mlp:  # (Nemotron's, Arcee's MLP)
            module = "fc_in"
        pairs.setdefault((layer, module), {})[side] = tensor.float()
        names[module] = name
    if not pairs:
        raise LoRAAdapterError(f"{path / WEIGHTS_FILE} holds no LoRA weights")
    for layer, module in [key for key in pairs if key[1] in _FUSED_QKV]:
        for part, sides in _split_fused_qkv(pairs.pop((layer, module)), specs[layer]).items():
            pairs[(layer, part)] = sides
            names[part] = module
    modules = {}
    for (layer, merged), parts in _merged_parts(pairs).items():
        spec = specs[layer]
        if spec.moe is not None and merged in ("gate_up_proj", "fc_in", "down_proj"):
            raise LoRAAdapterError(f"{path}: layer {layer}'s MLP is a mixture of experts, "
                                   f"which takes no adapter here")
        if merged in ("gate_up_proj", "fc_in") and (merged == "fc_in") == spec.gated_mlp:
            raise LoRAAdapterError(f"{path}: layer {layer}: the base model's MLP is "
                                   f"{'gated' if spec.gated_mlp else 'ungated'}, which has no "
                                   f"{', '.join(names[m] for m in parts)}")
        modules[(layer, merged)] = _merge(path, config, layer, merged, parts, spec,
                                          max_lora_rank, names)
    return LoRAAdapter(name, path, modules)


def _split_fused_qkv(sides: dict[str, torch.Tensor], spec: LayerSpec) -> dict:
    """A fused q/k/v adapter (GPT-2's and GPT-BigCode's c_attn, GPT-NeoX's and Falcon's
    query_key_value; B's rows as the base model's checkpoint holds them, ``spec.qkv_groups``)
    as q's, k's and
    v's: each takes the one A and its rows of B (x A^T B^T's rows are those parts' outputs); B
    of another size is left whole, for the shape check to name."""
    if set(sides) != {"A", "B"}:
        return {"q_proj": sides}  # (the pair check names what is missing)
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    b = sides["B"]
    if b.shape[0] != q + 2 * kv:
        return {"q_proj": sides}
    if spec.qkv_groups:  # every q head, then every k head, then every v head
        b = qkv_regrouped(b, spec.qkv_groups, spec.num_heads // spec.qkv_groups)
    return {part: {"A": sides["A"], "B": rows}
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), b.split((q, kv, kv)))}


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise LoRAAdapterError(f"{path}: no such adapter directory")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoRAAdapterError(f"{path}: no {CONFIG_FILE}") from None
    except json.JSONDecodeError as exc:
        raise LoRAAdapterError(f"{path / CONFIG_FILE}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{path / CONFIG_FILE}: not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{path / CONFIG_FILE}: peft_type {config['peft_type']!r} is "
                               f"not LoRA")
    # (fan_in_fan_out: PEFT's mark of a Conv1D base layer, GPT-2's, whose stored weight is
    # transposed; the adapter's A and B are a Linear's either way)
    if config.get("use_dora"):
        raise LoRAAdapterError(f"{path / CONFIG_FILE}: DoRA is not implemented")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{path / CONFIG_FILE}: bias {config['bias']!r} (trained "
                               f"biases) is not implemented; only 'none'")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(f"{path / CONFIG_FILE}: modules_to_save "
                               f"{config['modules_to_save']} (modules saved whole) is not "
                               f"implemented")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAAdapterError(f"{path / CONFIG_FILE}: {key} must be a positive number, "
                                   f"got {value!r}")
    return config


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing"
        raise LoRAAdapterError(f"{path}: no {WEIGHTS_FILE} (found {found})")
    try:
        return load_file(file)
    except (SafetensorError, OSError) as exc:
        raise LoRAAdapterError(f"{file}: not a safetensors file ({exc})") from None


def _merged_parts(pairs) -> dict[tuple[int, str], dict[str, dict[str, torch.Tensor]]]:
    """(layer, engine layer) -> transformers' parts -> their A and B."""
    merged: dict[tuple[int, str], dict[str, dict[str, torch.Tensor]]] = {}
    for (layer, module), sides in sorted(pairs.items()):
        merged.setdefault((layer, _LAYER_OF[module]), {})[module] = sides
    return merged


def _merge(path: Path, config: dict, layer: int, merged: str, parts, spec: LayerSpec,
           max_lora_rank: int, names: dict[str, str]) -> LoRAModule:
    """The parts' adapters as one of the merged layer (see the module's docstring)."""
    in_features = _INPUTS[merged](spec)
    a_blocks, b_blocks, rows, row, part_ranks = [], [], 0, {}, []
    for module, size_of in _PARTS[merged]:
        row[module] = rows
        rows += size_of(spec)
    for module, _ in _PARTS[merged]:  # in the layer's order
        sides = parts.get(module)
        if sides is None:
            part_ranks.append(0)
            continue
        where = f"{path / WEIGHTS_FILE}: layer {layer} {names[module]}"
        if set(sides) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: lora_A and lora_B come in pairs; only "
                                   f"lora_{''.join(sides)} is there")
        a, b = sides["A"], sides["B"]
        rank = a.shape[0]
        out_features = dict(_PARTS[merged])[module](spec)
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise LoRAAdapterError(f"{where}: lora_A {tuple(a.shape)} and lora_B "
                                   f"{tuple(b.shape)} do not fit the base model's "
                                   f"[{out_features}, {in_features}] projection")
        if rank > max_lora_rank:
            raise LoRAAdapterError(f"{where}: rank {rank} exceeds --max-lora-rank "
                                   f"{max_lora_rank}")
        a_blocks.append(a)
        part_ranks.append(rank)
        block = "self_attn" if merged in ("qkv_proj", "o_proj") else "mlp"
        scale = _scale(config, f"model.layers.{layer}.{block}.{names[module]}", rank)
        if module in ("q_proj", "k_proj"):  # its rows as the base model's (rope_layout)
            b = reordered(b, spec.rope_order, spec.head_dim)
        b_blocks.append((row[module], b * scale))
    total_rank = sum(a.shape[0] for a in a_blocks)
    b = torch.zeros(rows, total_rank)
    column = 0
    for first_row, block in b_blocks:
        b[first_row:first_row + block.shape[0], column:column + block.shape[1]] = block
        column += block.shape[1]
    return LoRAModule(torch.cat(a_blocks).contiguous(), b, tuple(part_ranks))


def _scale(config: dict, module: str, rank: int) -> float:
    """PEFT's: ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA; the alpha of the first
    ``alpha_pattern`` that ends the module's name (``model.layers.0.self_attn.q_proj``), as
    PEFT matches them; the rank is the tensors' (which ``rank_pattern`` set)."""
    alpha = next((value for pattern, value in (config.get("alpha_pattern") or {}).items()
                  if re.match(rf"(.*\.)?({pattern})$", module)), config["lora_alpha"])
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


class LoRAChecker:
    """The frontend's check of a request's adapter before the request enters: its directory
    read once per (id, path), so a malformed one is a clear error for that request alone and
    never a fault in a worker's step. An id names one adapter: another name or directory
    under an id already seen is refused. The read runs on a passing thread: torch work on the
    frontend's own would give it an OpenMP pool for good, and a process with more pool threads
    than cores slows every step of the worker (4.5 ms a SmolLM2 decode step became 20)."""

    def __init__(self, specs: list[LayerSpec], max_lora_rank: int):
        self.specs, self.max_lora_rank = specs, max_lora_rank
        self._seen: dict[int, tuple[str, str]] = {}  # lora_int_id -> (name, path) read fine

    def check(self, lora) -> None:
        """``lora``: a ``LoRARequest``; raises LoRAAdapterError (a ValueError) if it cannot
        run."""
        named = (lora.lora_name, str(lora.lora_path))
        seen = self._seen.get(lora.lora_int_id)
        if seen == named:
            return
        if seen is not None:
            raise LoRAAdapterError(f"lora_int_id {lora.lora_int_id} is adapter {seen[0]!r} "
                                   f"({seen[1]}); {lora.lora_name!r} needs an id of its own")
        try:  # (its torch work off this thread: see actorlm.openmp)
            on_passing_thread(load_lora_adapter, lora.lora_name, lora.lora_path, self.specs,
                              self.max_lora_rank)
        except LoRAAdapterError as exc:
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r}: {exc}") from None
        self._seen[lora.lora_int_id] = named


def lora_checker(config, hf_config) -> LoRAChecker | None:
    """The frontend's checker for an engine of ``config`` (an ``EngineConfig``) on a model of
    ``hf_config``; None where LoRA is off."""
    if not config.enable_lora or hf_config is None:
        return None
    from actorlm.models.families import layer_specs

    return LoRAChecker(layer_specs(hf_config), config.max_lora_rank)
